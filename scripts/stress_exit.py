r"""Launch a short multi-process dspzoo run many times and count the launches that exit non-zero.

    python scripts/stress_exit.py --runs 30                  # 30 launches of 3 processes
    python scripts/stress_exit.py --runs 30 --launcher direct
    python scripts/stress_exit.py --runs 30 --bare            # the issue's reproduction
    python scripts/stress_exit.py --runs 30 --bare --released # ... ended by the fix

Each launch starts ``--nproc`` processes (``torch.distributed.run`` by default, as ``accelerate
launch`` does; ``--launcher direct`` starts the ranks itself, rank 0 then hosting the store);
each process builds the mesh at SP = ``--nproc``, runs one forward and backward of a small 2-D
axial transformer under DDP, checks its loss against the single-process loss, and exits
through the same entry-point wrapper as every dspzoo script. A launch counts as failed when
the launcher or any rank exits non-zero (an abort at exit shows as ``Signal 6 (SIGABRT)``).
Prints one line per failed launch and ``non-zero exits: K/N``; exits 1 when K > 0.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

CHILD_FLAG = "--child"
BARE_FLAG = "--bare"
RELEASED_FLAG = "--released"
CHILD_ARGS = [CHILD_FLAG]


def child() -> None:
    """One rank: mesh at SP = world, a forward/backward at that SP size, then exit."""
    import torch

    from dspzoo.core import SeqParallel, single_process_mesh, sp_mse, sp_report
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.domains.toy.model import Toy2DConfig, Toy2DTransformer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator, mesh, sp = setup_accelerate(sp_size=world, seed=0)
    cfg = Toy2DConfig(in_channels=4, hidden=16, heads=2, depth=1, max_t=5, max_s=7)
    torch.manual_seed(0)
    model = Toy2DTransformer(cfg)
    reference = Toy2DTransformer(cfg)
    reference.load_state_dict(model.state_dict())
    wrapped = accelerator.prepare(model)
    g = torch.Generator().manual_seed(1)
    x, target = (torch.randn(1, 5, 7, 4, generator=g) for _ in range(2))
    out = wrapped(x, sp, gather_output=False)
    loss = sp_mse(out.tensor, sp.shard_like(target, out), sp.group)
    loss.backward()
    expected = torch.nn.functional.mse_loss(
        reference(x, SeqParallel(single_process_mesh())), target
    )
    got = sp_report(loss, sp.group)
    if abs(got - expected.item()) > 1e-5 * max(1.0, abs(expected.item())):
        raise AssertionError(f"rank {mesh.rank}: loss {got} != single process {expected.item()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_torchrun(nproc: int, timeout: float) -> tuple[list[int], str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(_free_port()),
        __file__,
        *CHILD_ARGS,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    rank_codes = [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", output)]
    return [done.returncode, *rank_codes], output


def _launch_direct(nproc: int, timeout: float) -> tuple[list[int], str]:
    port = _free_port()
    procs = []
    with tempfile.TemporaryFile("w+") as log:
        for rank in range(nproc):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                OMP_NUM_THREADS="1",
            )
            command = [sys.executable, __file__, *CHILD_ARGS]
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        log.seek(0)
        return codes, log.read()


def bare_reproduction(release: bool) -> None:
    """The issue's 10-line reproduction of the abort at exit: gloo, ``torch.distributed.
    device_mesh`` imported, one ``all_to_all_single`` on the default group, then
    ``destroy_process_group()`` (torch 2.13 aborts in some launches) — or, with ``release``,
    dspzoo's :func:`~dspzoo.core.entry.release_communicators` in its place (the fix)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401  (the trigger)

    dist.init_process_group("gloo")
    sent = torch.arange(dist.get_world_size(), dtype=torch.float32)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=dist.group.WORLD)
    if release:
        from dspzoo.core.entry import release_communicators

        release_communicators()
    else:
        dist.destroy_process_group()


def main() -> None:
    if CHILD_FLAG in sys.argv:
        from dspzoo.core.entry import run_entry_point

        if BARE_FLAG in sys.argv:
            bare_reproduction(release=RELEASED_FLAG in sys.argv)
            return
        run_entry_point(child, "stress_exit")
        return
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=30, help="launches (default: 30)")
    parser.add_argument("--nproc", type=int, default=3, help="processes per launch (default: 3)")
    parser.add_argument(
        "--launcher",
        choices=["torchrun", "direct"],
        default="torchrun",
        help="torch.distributed.run (default) or start the ranks directly",
    )
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds per launch (default: 120)"
    )
    parser.add_argument(
        BARE_FLAG,
        action="store_true",
        help="launch the issue's 10-line reproduction instead of a dspzoo run (the count "
        "before the fix)",
    )
    parser.add_argument(
        RELEASED_FLAG,
        action="store_true",
        help=f"with {BARE_FLAG}: end it with dspzoo's release_communicators (the fix)",
    )
    args = parser.parse_args()
    if args.bare:
        CHILD_ARGS.append(BARE_FLAG)
        if args.released:
            CHILD_ARGS.append(RELEASED_FLAG)
    launch = _launch_torchrun if args.launcher == "torchrun" else _launch_direct
    failed = 0
    for run in range(1, args.runs + 1):
        codes, output = launch(args.nproc, args.timeout)
        if any(codes):
            failed += 1
            reasons = sorted(set(re.findall(r"terminate called[^\n]*|Signal \d+ \(\w+\)", output)))
            print(f"launch {run}: exit codes {codes} {'; '.join(reasons)}", flush=True)
    print(f"non-zero exits: {failed}/{args.runs} ({args.nproc} processes, {args.launcher})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
