"""The ``aiosnap`` command line (also ``python -m aiosnap``).

For now: ``aiosnap resume --config FILE`` finishes the uploads a crashed training process
left in its spool and commits them, without any training code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .checkpointer import SyncCheckpointer
from .config import load_config
from .errors import AiosnapError

__all__ = ["main"]


def _resume(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if config.spool.effective_mode == "off":
        print(f"aiosnap: {args.config}: no spool configured (spool.dir), nothing to resume", file=sys.stderr)
        return 1
    config = config.model_copy(update={"spool": config.spool.model_copy(update={"resume": True})})
    with SyncCheckpointer(config) as ckpt:
        report = ckpt.resume_report
        steps = ckpt.steps()
    if args.json:
        print(json.dumps({"resumed": report.resumed, "discarded": report.discarded, "failed": report.failed,
                          "skipped": report.skipped, "committed_steps": steps}))  # fmt: skip
    else:
        print(f"resumed and committed: {report.resumed or 'none'}")
        for save_id, why in report.discarded:
            print(f"discarded {save_id}: {why}")
        for save_id, why in report.failed:
            print(f"FAILED {save_id} (kept in the spool): {why}")
        for save_id, why in report.skipped:
            print(f"skipped {save_id}: {why}")
        print(f"committed steps in {ckpt.url}: {steps}")
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiosnap", description="aiosnap checkpoint tool")
    commands = parser.add_subparsers(dest="command", required=True)
    resume = commands.add_parser("resume", help="finish and commit spooled saves left by a crashed process")
    resume.add_argument("--config", required=True, help="the training job's YAML config")
    resume.add_argument("--json", action="store_true", help="machine-readable output")
    resume.set_defaults(run=_resume)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        code: int = args.run(args)
    except (AiosnapError, OSError) as exc:
        print(f"aiosnap: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
