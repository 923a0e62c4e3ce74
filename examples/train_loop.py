"""A plain training loop checkpointed with aiosnap's sync API (what `make demo` runs).

Resumes from the latest checkpoint when there is one (``ckpt.load_latest``: the model,
optimizer, LR scheduler and RNG state come back as they were), trains ``--steps`` more steps,
saving every ``--every`` into a local directory (./checkpoints unless --config points
elsewhere), then restores the newest checkpoint into freshly built objects and checks they
equal the trained ones. Run it again and it goes on where the last run stopped.
"""

from __future__ import annotations

import argparse
import sys
import time

import aiosnap
import torch


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=1000)
    return model, optim, sched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML config file (default: built-in, ./checkpoints)")
    parser.add_argument("--steps", type=int, default=300, help="steps to train in this run")
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    config = aiosnap.load_config(args.config) if args.config else aiosnap.Config()

    torch.manual_seed(0)
    model, optim, sched = build()
    target = torch.randn(64, 10)
    handles = []
    with aiosnap.SyncCheckpointer(config) as ckpt:
        state = {"model": model, "optim": optim, "sched": sched, "rng": aiosnap.RNGState()}
        done = ckpt.load_latest(state)  # the steps an earlier run saved; None on the first run
        start = 1 if done is None else done + 1
        resumed = "a fresh start" if done is None else f"resumed from step {done}"
        print(
            f"aiosnap demo: {resumed}; steps {start}-{start + args.steps - 1}, a checkpoint every {args.every}, "
            f"into {ckpt.url} (loop: {ckpt.loop_kind})"
        )
        for step in range(start, start + args.steps):
            x = torch.randn(32, 64)
            loss = torch.nn.functional.cross_entropy(model(x), (x @ target).argmax(1))
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            if step % args.every == 0:
                started = time.perf_counter()
                handles.append(ckpt.save(state, step=step, metadata={"loss": loss.item()}))
                blocked_ms = (time.perf_counter() - started) * 1e3
                print(f"  step {step:4d}  loss {loss.item():.4f}  save() returned in {blocked_ms:.1f} ms")
        for handle in handles:
            result = handle.wait()
            print(
                f"  step {result.step:4d} durable: {result.nbytes / 2**20:.2f} MiB in {result.objects} object(s), "
                f"{result.durable_s * 1e3:.1f} ms after save()"
            )
        print(f"committed steps kept (retention keep_last={config.retention.keep_last}): {ckpt.steps()}")

        fresh_model, fresh_optim, fresh_sched = build()
        ckpt.load({"model": fresh_model, "optim": fresh_optim, "sched": fresh_sched})
        manifest = ckpt.manifest(ckpt.loaded_step)
    same_model = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True)
    )
    saved_optim, loaded_optim = optim.state_dict(), fresh_optim.state_dict()
    same_optim = saved_optim["param_groups"] == loaded_optim["param_groups"] and all(
        torch.equal(saved_optim["state"][i][k], loaded_optim["state"][i][k])
        for i in saved_optim["state"]
        for k in saved_optim["state"][i]
    )
    print(
        f"restored step {manifest.step} (metadata {manifest.metadata}) into fresh objects: "
        f"model equal={same_model}, optimizer equal={same_optim}, "
        f"lr equal={sched.get_last_lr() == fresh_sched.get_last_lr()}"
    )
    return 0 if same_model and same_optim else 1


if __name__ == "__main__":
    sys.exit(main())
