"""``kvtier run``: generate for prompts from flags, files or JSONL, with a tiered KV cache."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .common import UsageError, check_sizes, engine_store, load_model
from .output import PRINTER_GRACE_S, Printer, print_summary
from .session import close_engine, open_engine


def read_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    # kvtier checks prompt lengths itself (one line); the tokenizer's own warning would be a second
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    if args.prompt is not None:
        texts: list = [sys.stdin.read() if text == "-" else text for text in args.prompt]
    elif args.prompt_file is not None:
        texts = [read_text(path) for path in args.prompt_file]
    else:
        texts = read_jsonl(args.prompts_file)
    prompts = []
    for item in texts:
        if isinstance(item, list):
            prompts.append(item)
        elif args.chat:
            messages = [{"role": "user", "content": item}]
            prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
        else:
            prompts.append(tokenizer.encode(item))
    return prompts


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None


def read_jsonl(path: Path) -> list:
    items = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            item = record["tokens"] if "tokens" in record else record["prompt"]
        except (ValueError, KeyError, TypeError):
            raise UsageError(f'{path}:{number}: expected {{"prompt": text}} or {{"tokens": [ids]}}') from None
        if not isinstance(item, (str, list)) or (isinstance(item, list) and not all(isinstance(t, int) for t in item)):
            raise UsageError(f"{path}:{number}: prompt must be text, tokens a list of ids")
        items.append(item)
    if not items:
        raise UsageError(f"{path} holds no prompts")
    return items


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here so that `kvtier --help` and bad arguments answer at once.
    from ..engine import InputError, check_prompt
    from ..request import SamplingParams

    store_dir = engine_store(args)
    check_sizes(args, store_dir)
    loaded = load_model(args.model)
    prompts = read_prompts(args, loaded.tokenizer)
    params = SamplingParams(args.max_tokens, args.temperature, args.top_p)
    try:
        for prompt in prompts:  # before any work: nothing computed, the store untouched
            check_prompt(loaded, prompt, params)
    except InputError as err:
        raise UsageError(str(err)) from None
    engine = open_engine(args, loaded, store_dir)
    requests = _generate(args, engine, loaded.tokenizer, prompts, params)
    if args.json:
        for request in requests:
            print(json.dumps(engine.result(request)))
        print(json.dumps({"counters": engine.stats().to_json()}))
    else:
        print_summary(engine.stats())
    return 0


def _generate(args: argparse.Namespace, engine, tokenizer, prompts: list[list[int]], params) -> list:
    """Run the prompts (all at once, or one after another with ``--sequential``), their
    text printed as it comes unless ``--json``; the engine is closed on every way out."""
    from ..engine import InputError

    printer = None if args.json else Printer(tokenizer, engine.result)
    requests, ended = [], False
    try:
        for batch in [[p] for p in prompts] if args.sequential else [prompts]:
            submitted = [engine.submit(p, params) for p in batch]
            if printer is not None:
                for request in submitted:
                    printer.add(request)
            requests += submitted
            engine.run()
        ended = True
    except InputError as err:
        raise UsageError(str(err)) from None
    finally:
        close_engine(engine, cancel=not ended)
        if printer:  # its last lines come before ours
            printer.finish(timeout=None if ended else PRINTER_GRACE_S)
    return requests
