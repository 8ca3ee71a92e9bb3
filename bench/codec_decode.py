"""A quantized page's decode alone, against ``mx.dequantize`` and a memcpy of the raw page.

    python bench/codec_decode.py [--codecs q8 k8v4 q4] [--pages 8] [--rounds 9] [--encode]

For one page geometry of the default model (float32 KV: 5.6 MiB a 128-token page),
``--pages`` random pages are quantized (each payload at an odd address, as in LMDB's
map), then each round decodes all of them into L2-like slots three ways, interleaved so
that a machine's load favours none:

- ``ours``: ``tiers.quant.decode`` (the codec's decode);
- ``mx.dequantize``: one ``mx.dequantize`` per half of a page, copied into its slot;
- ``memcpy``: the raw pages copied into the slots (what a raw page's restore copies).

Prints the median seconds of each and the ratios (``mx.dequantize`` / ours, ours /
memcpy), and checks that ours gives ``mx.dequantize``'s bytes. ``--encode`` adds the
encode (``tiers.quant.encode``, mlx's ``mx.quantize``) per page.
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
import numpy as np

from kvtier.engine.models.load import load_model
from kvtier.tiers.page import PageGeometry
from kvtier.tiers.quant import BITS, GROUP, PageCodec
from kvtier.tiers.tier import kv_to_host


def with_mx_dequantize(codec: str, payload: memoryview, layers: int, out: np.ndarray) -> None:
    """A page decoded by ``mx.dequantize``, one call a half, copied into ``out``."""
    rows = out.view(np.float32).reshape(layers, 2, -1)
    values = rows[:, 0].size
    at = 8  # tiers.quant.PREFIX
    for half, bits in enumerate(BITS[codec]):
        sizes = (values * bits // 8, values // GROUP * 4, values // GROUP * 4)
        words, scales, biases = (np.frombuffer(payload, np.uint8, n, at + sum(sizes[:i])) for i, n in enumerate(sizes))
        at += sum(sizes)
        plain = mx.dequantize(
            mx.array(words.view(np.uint32)).reshape(values // GROUP, -1),
            mx.array(scales.view(np.float32)).reshape(-1, 1),
            mx.array(biases.view(np.float32)).reshape(-1, 1),
            GROUP,
            bits,
        )
        np.copyto(rows[:, half], np.asarray(plain).reshape(layers, -1))


def measure(
    codec: str, geometry: PageGeometry, raws: list[np.ndarray], slots: list[np.ndarray], rounds: int
) -> tuple[dict[str, float], float]:
    """Median seconds of each way of decoding ``raws`` quantized with ``codec`` into
    ``slots``, and the encode's seconds a page."""
    pages = PageCodec.of(geometry, codec)
    assert pages is not None, codec
    t0 = time.perf_counter()
    # at an odd address, as LMDB's map hands a payload over (after its record's header)
    payloads = [memoryview(b"\0" + pages.encode(codec, raw))[1:] for raw in raws]
    encode_s = (time.perf_counter() - t0) / len(raws)
    ways = {
        "ours": lambda: [pages.decode(p, s) for p, s in zip(payloads, slots)],
        "mx.dequantize": lambda: [
            with_mx_dequantize(codec, p, geometry.num_layers, s) for p, s in zip(payloads, slots)
        ],
        "memcpy": lambda: [np.copyto(s, r) for r, s in zip(raws, slots)],
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(rounds + 1):  # the first warms the slots and mlx's buffers
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            if i:
                seconds[name].append(time.perf_counter() - t0)
    check = np.empty(geometry.nbytes, np.uint8)
    with_mx_dequantize(codec, payloads[0], geometry.num_layers, check)
    assert pages.decode(payloads[0]).tobytes() == check.tobytes(), "ours differs from mx.dequantize"
    return {name: statistics.median(s) for name, s in seconds.items()}, encode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=list(BITS))
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--encode", action="store_true")
    args = parser.parse_args()
    geometry = load_model().geometry(128)
    assert geometry.dtype == "float32", geometry.dtype
    rng = np.random.default_rng(0)
    raws = [kv_to_host(mx.array(rng.standard_normal(geometry.shape, dtype=np.float32))) for _ in range(args.pages)]
    slots = [np.empty(geometry.nbytes, np.uint8) for _ in raws]
    print(f"{args.pages} pages of {geometry.nbytes / (1 << 20):.2f} MiB, median of {args.rounds} rounds")
    for codec in args.codecs:
        med, encode_s = measure(codec, geometry, raws, slots, args.rounds)
        line = (
            f"{codec:>5}: ours {med['ours'] * 1e3:7.1f} ms, mx.dequantize {med['mx.dequantize'] * 1e3:7.1f} ms, "
            f"memcpy {med['memcpy'] * 1e3:6.1f} ms; mx.dequantize / ours {med['mx.dequantize'] / med['ours']:.2f}x, "
            f"ours / memcpy {med['ours'] / med['memcpy']:.2f}x"
        )
        print(line + (f"; encode {encode_s * 1e3:.1f} ms a page" if args.encode else ""))


if __name__ == "__main__":
    main()
