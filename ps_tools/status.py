"""``ps-status``: the cluster at a glance, from each server's Status.

    ps-status 127.0.0.1:50051                 # once
    ps-status 127.0.0.1:50051 --watch 2       # refresh every 2 s until Ctrl-C
    ps-status a:50051,b:50051                 # server shards: the cluster, then one block each
    ps-status 127.0.0.1:50051 --membership 0  # without the membership history (default: its newest 20)

Per server: mode, version, round, who the barrier (sync) or the bound (ssp) is
waiting for, updates applied and dropped, staleness, checkpoint age. Per
worker: its state (training; in sync, awaited by the barrier or waiting at it
having pushed; left when finished; DEAD), last step, lease age (seconds
since its last call or heartbeat), pushes, and where its time goes (``work``:
between its pushes; ``wait``: inside them, at the barrier or the bound); a worker
whose index a second process took since says so (``process 2 on this index``).
With several shards a first block shows the cluster as the workers see it:
the shards' statuses combined by ``worker.sharded_client.combine_statuses``
(one rule per field). When the server deals the data (``ps-worker --elastic``), the
examples each epoch applied and, in async and ssp, the tasks. Then the membership over time (``core.membership``), the
newest ``--membership N`` events: when (local time), the round and version the
server was at, what happened (joined, rejoined, left, dead) and to which worker
(once per cluster: with shards, in the cluster block). Plain text; no TensorFlow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from protos.wire import mode_from_wire


def render(address: str, s, history: int = 0) -> str:
    """One server's block; with ``history`` > 0, its newest membership events after the workers."""
    mode = mode_from_wire(s.mode)
    lines = [f"{address}  mode {mode}  version {s.version}  round {s.round}  workers {s.num_workers}"
             + ("" if s.initialized else "  (not initialized: waiting for the chief)")]
    alive = [w for w in s.workers if not w.left and not w.dead]
    if mode == "sync" and s.waiting_for:
        lines.append(f"  barrier of round {s.round} waits for: "
                     + ", ".join(_who(s, w) for w in s.waiting_for))
    elif mode == "ssp" and s.waiting_for and len(alive) > 1:
        lines.append(f"  slowest (the staleness bound {s.staleness} holds the others to it): "
                     + ", ".join(_who(s, w) for w in s.waiting_for))
    else:
        lines.append("  nobody is waited for")
    extra = []
    if s.pushes_dropped:
        extra.append(f"dropped {s.pushes_dropped}")
    if s.pushes_scaled:
        extra.append(f"scaled {s.pushes_scaled}")
    if s.rounds_aborted or s.rounds_timed_out:
        extra.append(f"rounds aborted {s.rounds_aborted}, timed out {s.rounds_timed_out}")
    if mode == "ssp":
        extra.append(f"max ahead {s.max_ahead} of bound {s.staleness}")
    if s.stale_gradient_policy and s.stale_gradient_policy != "none":
        extra.append(f"stale policy {s.stale_gradient_policy}" + (f" (drops staleness above {s.max_staleness})"
                                                                  if s.stale_gradient_policy == "drop" else ""))
    checkpoint = (f"checkpoint v{s.last_checkpoint_version} {s.checkpoint_age_s:.0f} s ago"
                  if s.last_checkpoint_version >= 0 else "no checkpoint")
    lines.append(f"  applied {s.pushes_applied} pushes, {s.examples_applied} examples; staleness mean "
                 f"{s.mean_staleness:.2f} max {s.max_staleness_seen}; {checkpoint}"
                 + (f"; {'; '.join(extra)}" if extra else ""))
    lines += data_lines(s)
    lines.append(f"  {'worker':>6}  {'state':<9} {'last step':>9} {'lease age':>9} {'pushes':>7} "
                 f"{'work (s)':>9} {'wait (s)':>9}  name")
    known = {w.worker_id: w for w in s.workers}
    for index in range(s.num_workers):
        w = known.get(index)
        if w is None:
            lines.append(f"  {index:>6}  {'absent':<9} {'-':>9} {'-':>9} {'-':>7} {'-':>9} {'-':>9}  (never registered)")
            continue
        state = "left" if w.left else "DEAD" if w.dead else "training"
        if mode == "sync" and s.waiting_for and state == "training":
            state = "awaited" if index in s.waiting_for else "waiting"  # waiting: pushed, at the barrier
        lines.append(f"  {index:>6}  {state:<9} {w.last_step:>9} {w.last_seen_age_s:>9.1f} {w.pushes:>7} "
                     f"{w.work_s:>9.3f} {w.wait_s:>9.3f}  {w.worker_name}"
                     + (f"  (process {w.incarnation} on this index)" if w.incarnation > 1 else ""))
    if history > 0:
        lines += membership_lines(s, history)
    return "\n".join(lines)


def data_lines(s) -> list[str]:
    """The data plan's progress, when the server deals the data (``ps-worker --elastic``):
    the examples each epoch applied, each once, of the dataset's; async and ssp's tasks."""
    if not s.num_examples:
        return []
    epochs = ", ".join(f"{e}: {n}/{s.num_examples}" for e, n in enumerate(s.epoch_examples)) or "none yet"
    line = f"  examples applied once per epoch: {epochs}"
    if s.tasks_total:
        line += (f"; tasks {s.tasks_done}/{s.tasks_total} done, {s.tasks_held} held, "
                 f"{s.tasks_queued} given back and waiting")
    return [line]


def membership_lines(s, newest: int) -> list[str]:
    """The membership over time as a compact table: the ``newest`` events, oldest first."""
    events = list(s.membership)
    if not events:
        return ["  membership: no worker has registered yet"]
    shown = events[-newest:]
    earlier = len(events) - len(shown) + s.membership_dropped
    lines = [f"  membership over time ({len(shown)} events" + (f", {earlier} earlier not shown)" if earlier else ")"),
             f"  {'time':<8} {'round':>7} {'version':>8}  {'event':<8}  worker"]
    for e in shown:
        name = f" ({e.worker_name})" if e.worker_name else ""
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e.wall_time)):<8} {e.round:>7} {e.version:>8}  "
                     f"{e.event:<8}  {e.worker_id}{name}")
    return lines


def _who(s, worker_id: int) -> str:
    for w in s.workers:
        if w.worker_id == worker_id:
            name = f" ({w.worker_name})" if w.worker_name else ""
            state = ", dead" if w.dead else ""
            return f"worker {worker_id}{name}{state}, last call {w.last_seen_age_s:.1f} s ago"
    return f"worker {worker_id} (never registered)"


def snapshot(addresses: list[str], token: str | None, timeout: float, history: int = 20) -> str:
    from worker.client import PSClient, PSClientError
    from worker.sharded_client import combine_statuses

    blocks, answers = [], []
    for address in addresses:
        try:
            with PSClient(address, timeout=timeout, token=token) as c:
                answers.append(c.status())
            blocks.append(render(address, answers[-1], history if len(addresses) == 1 else 0))
        except PSClientError as e:
            blocks.append(f"{address}  not answering: {e.code.name if e.code else 'ERROR'}: {e.details}")
    if len(addresses) > 1 and len(answers) == len(addresses):
        blocks.insert(0, render(f"cluster of {len(addresses)} shards", combine_statuses(answers), history))
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ps-status", description="Print a tfps cluster at a glance.")
    p.add_argument("ps", help="server HOST:PORT, or shards HOST:PORT,HOST:PORT,...")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, help="refresh every N seconds (default 2)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per Status call (default 5)")
    p.add_argument("--membership", type=int, default=20, metavar="N",
                   help="show the newest N membership events: who joined, left or died, when, at which round "
                   "(default 20; 0: none)")
    args = p.parse_args(argv)
    from ps_common import security

    token = security.load_token(None, os.environ)
    addresses = [a.strip() for a in args.ps.split(",") if a.strip()]
    if args.watch is None:
        text = snapshot(addresses, token, args.timeout, args.membership)
        print(text, flush=True)
        return 1 if "not answering" in text else 0
    try:
        while True:
            text = snapshot(addresses, token, args.timeout, args.membership)
            clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
            print(f"{clear}{time.strftime('%H:%M:%S')}\n{text}\n", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
