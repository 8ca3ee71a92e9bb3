"""The README's dashboard screenshot, and what the page costs.

Starts ``kvtier serve`` (the default model unless --model) on a free port with a fresh
store, sends the README's three agent prompts (examples/agent_prompts.jsonl) as chat
requests, one after another, then opens ``/dashboard`` in headless Chromium (Debian's
``chromium`` and ``chromium-driver``) and saves a PNG. It prints the page's weight
(every file the page loads) and the feed's cost (the mean time of one
``GET /v1/kvtier/dashboard`` and its size, beside ``/v1/kvtier/stats``).

    .venv/bin/python bench/dashboard_screenshot.py                      # bench/dashboard.png
    .venv/bin/python bench/dashboard_screenshot.py --width 390 --out /tmp/phone.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
from selenium import webdriver
from serve_common import kvtier_server, stream_chat

REPO = Path(__file__).resolve().parents[1]
PAGE_FILES = ("/dashboard", "/dashboard/static/dashboard.css", "/dashboard/static/dashboard.js")
CHART = "/dashboard/static/chart.umd.min.js"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the server's default model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "dashboard.png")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1200, help="of the window; the PNG is the whole page")
    parser.add_argument("--polls", type=int, default=50, help="feed reads to time")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = Path(tempfile.mkdtemp(prefix="kvtier-dash-"))
    server = kvtier_server(args.model, port, store, "--max-tokens", "32").start()
    driver = browser(args.width, args.height)
    try:
        driver.get(server.url + "/dashboard")  # open while the requests run: the charts see them
        with httpx.Client(timeout=300) as http:
            for line in (REPO / "examples" / "agent_prompts.jsonl").read_text().splitlines():
                reply = stream_chat(http, server, [{"role": "user", "content": json.loads(line)["prompt"]}], 32)
                print(f"request: TTFT {reply.ttft_s * 1000:.0f} ms, sources {reply.usage['prompt_tokens_details']}")
            weight(http, server.url)
            feed_cost(http, server.url, args.polls)
        time.sleep(3)  # a few more polls
        height = driver.execute_script("return document.documentElement.scrollHeight")
        metrics = {"width": args.width, "height": height, "deviceScaleFactor": 1, "mobile": args.width < 600}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # the whole page in one PNG
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
    finally:
        driver.quit()
        server.stop()
        shutil.rmtree(store, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


def weight(http: httpx.Client, url: str) -> None:
    own = sum(len(http.get(url + path).content) for path in PAGE_FILES)
    chart = len(http.get(url + CHART).content)
    print(f"page weight: {own + chart} bytes ({own} page, script and style; {chart} Chart.js), uncompressed")


def feed_cost(http: httpx.Client, url: str, polls: int) -> None:
    """The feed beside /v1/kvtier/stats (what it adds: the ring, the namespaces)."""
    for path in ("/v1/kvtier/dashboard", "/v1/kvtier/stats"):
        t0 = time.perf_counter()
        sizes = [len(http.get(url + path).content) for _ in range(polls)]
        mean = (time.perf_counter() - t0) / polls
        print(f"{path}: {mean * 1000:.1f} ms per GET over {polls}, {sizes[-1]} bytes")


def browser(width: int, height: int) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))


if __name__ == "__main__":
    sys.exit(main())
