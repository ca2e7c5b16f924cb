"""A 2-node job on this machine, and the cost model's link for node-local and spanning SP groups.

Two ``torchrun`` launchers (``--nnodes 2 --node_rank 0/1``, rendezvous on 127.0.0.1 at a free
port, 2 processes each) train a tiny video DiT with ``scripts/train_video.py --sp 2`` (dp 2):
the losses equal one process's, and the mesh's start-up summary (from every rank's launcher
environment, all-gathered) puts each SP group on one node and the DP groups across the nodes.
Both launchers run in their own process group, are killed at a deadline and never hang.

The cost model prices a switch of an SP group the mesh placed on one node on the intra-node
link, and of one spanning nodes (``DSPZOO_SP_ACROSS_NODES``) on the inter-node link — even where
the preset's ``gpus_per_node`` alone would have put it inside a node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspzoo.core.costmodel.cluster import PRESETS
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.nodes import NodeLayout

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    model="stdit-tiny",
    steps=4,
    global_batch=2,
    frames=5,
    size=24,
    num_samples=8,
    log_every=1,
    warmup=2,
)
DEADLINE_S = 240


# -- the cost model's link -----------------------------------------------------------------------


def _mesh(nodes: tuple[tuple[int, ...], ...], sp: int, node_local: bool) -> SPMesh:
    world = sum(len(n) for n in nodes)
    layout = NodeLayout(nodes, tuple(f"host{i}" for i in range(len(nodes))), "GROUP_RANK")
    return SPMesh(
        world_size=world,
        rank=0,
        dp_size=world // sp,
        sp_size=sp,
        dp_rank=0,
        sp_rank=0,
        node_layout=layout,
        sp_is_node_local=node_local,
    )


def test_a_node_local_switch_is_priced_on_the_intra_node_link() -> None:
    cluster = PRESETS["h100-nvlink-ib"]
    nbytes, collectives = 64e6, 3
    placed = cluster.placed(_mesh(((0, 1, 2, 3), (4, 5, 6, 7)), sp=4, node_local=True))
    assert placed.link(4)[0] == 0.0
    intra = collectives * cluster.intra_lat + nbytes / cluster.intra_bw
    assert placed.transfer_time(nbytes, 4, collectives) == pytest.approx(intra, rel=1e-12)


def test_a_switch_spanning_nodes_is_priced_on_the_inter_node_link() -> None:
    cluster = PRESETS["h100-nvlink-ib"]  # 8 GPUs a node: SP 2 alone would look node-local
    nbytes, collectives = 64e6, 3
    one_a_node = cluster.placed(_mesh(((0,), (1,)), sp=2, node_local=False))
    assert one_a_node.link(2)[0] == 1.0
    inter = collectives * cluster.inter_lat + nbytes / cluster.inter_bw
    assert one_a_node.transfer_time(nbytes, 2, collectives) == pytest.approx(inter, rel=1e-12)
    assert cluster.transfer_time(nbytes, 2, collectives) < inter / 5  # unplaced: intra-node
    # sp 4 over two nodes of two: a rank's 3 peers, 2 off-node; the slower link bounds the time
    half = cluster.placed(_mesh(((0, 1), (2, 3)), sp=4, node_local=False))
    assert half.link(4)[0] == pytest.approx(2 / 3)
    expected = collectives * cluster.inter_lat + max(
        nbytes / 3 / cluster.intra_bw, nbytes * 2 / 3 / cluster.inter_bw
    )
    assert half.transfer_time(nbytes, 4, collectives) == pytest.approx(expected, rel=1e-12)
    # NCCL's ring steps: an SP group split 3 + 1 over two nodes of three crosses the node
    # boundary once (like 2 + 2), not once per rank of its smallest part
    uneven = cluster.placed(_mesh(((0, 1, 2), (3, 4, 5)), sp=4, node_local=False))
    assert uneven.sp_layout == (4, 1, 2) and half.sp_layout == (4, 2, 2)
    gather = cluster.coll_base_lat + 2 * cluster.coll_step_lat_intra + cluster.coll_step_lat_inter
    for placed in (uneven, half):
        assert placed.collective_latency("all_gather", 4) == pytest.approx(gather, rel=1e-12)
    # another group size than the mesh's keeps the preset's consecutive-ranks pricing
    assert half.transfer_time(nbytes, 8, collectives) == cluster.transfer_time(
        nbytes, 8, collectives
    )


def test_the_placed_cluster_reaches_the_step_time_prediction() -> None:
    from dspzoo.core.costmodel import predict
    from dspzoo.zoo.workloads import workload_for

    wl = workload_for("stdit-tiny", frames=16, spatial=16, overrides={"cond_dim": 0})
    cluster = PRESETS["h100-nvlink-ib"]
    local = predict(wl, "dsp", 2, cluster.placed(_mesh(((0, 1),), 2, True)))
    spanning = predict(wl, "dsp", 2, cluster.placed(_mesh(((0,), (1,)), 2, False)))
    assert local.comm_s == predict(wl, "dsp", 2, cluster).comm_s
    assert spanning.bytes == local.bytes and spanning.collectives == local.collectives
    # the same bytes and collectives; every ring step now crosses the node boundary (NCCL's
    # latency model: 6 all-to-alls take one step each; no exit all-gather: training takes the
    # flow loss on each rank's shard)
    assert spanning.collectives == 6
    steps = spanning.collectives
    step_cost = cluster.coll_step_lat_inter - cluster.coll_step_lat_intra
    slower = steps * step_cost + spanning.bytes * (1 / cluster.inter_bw - 1 / cluster.intra_bw)
    assert spanning.comm_s - local.comm_s == pytest.approx(slower, rel=1e-9)


# -- two launchers, one machine ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(out: Path) -> list[str]:
    return [
        f"--output-dir={out}",
        "--save-every=0",
        *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()),
    ]


def _clean_env() -> dict[str, str]:
    """This environment without a launcher's variables (pytest may itself run under one)."""
    skip = ("TORCHELASTIC", "GROUP_", "LOCAL_", "ROLE_", "MASTER_", "NODE_RANK", "RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip) and k != "WORLD_SIZE"}
    return {**env, "OMP_NUM_THREADS": "1", "DSPZOO_COLLECTIVE_TIMEOUT": "60"}


def _run_two_nodes(out: Path) -> list[tuple[int, str]]:
    """Launch node 0 and node 1 (``torchrun --nnodes 2``) and wait for both, with a deadline
    after which both launchers and their workers are killed. Returns ``(status, output)``."""
    port = _free_port()
    launchers = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node_rank}",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(REPO / "scripts" / "train_video.py"),
            *_flags(out),
            "--sp=2",
        ]
        log = open(out.parent / f"node{node_rank}.log", "w+")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_clean_env(), start_new_session=True
        )
        launchers.append((proc, log))
    deadline = time.monotonic() + DEADLINE_S
    try:
        for proc, _ in launchers:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, _ in launchers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    results = []
    for proc, log in launchers:
        log.seek(0)
        results.append((proc.returncode, log.read()))
        log.close()
    return results


def test_two_nodes_of_two_processes_repeat_one_process(tmp_path: Path) -> None:
    from dspzoo.domains.video.training import VideoTrainConfig, train

    reference = train(
        VideoTrainConfig(**TINY, sp=1, output_dir=str(tmp_path / "one"), save_every=0)
    )["losses"]
    out = tmp_path / "two_nodes"
    (node0, log0), (node1, log1) = _run_two_nodes(out)
    assert node0 == 0 and node1 == 0, f"node 0:\n{log0[-3000:]}\nnode 1:\n{log1[-3000:]}"
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses) == len(reference) == TINY["steps"]
    assert losses == pytest.approx(reference, rel=1e-5), (reference, losses)
    summary = [line for line in log0.splitlines() if "mesh dp 2 × sp 2" in line]
    assert len(summary) == 1, log0[-3000:]  # said once, by global rank 0 (node 0)
    assert "2 node(s) × 2 processes (nodes from GROUP_RANK" in summary[0]
    assert (
        "SP groups node-local ([0, 1] on node 0, [2, 3] on node 1), DP groups across nodes"
        in summary[0]
    )
    assert "mesh dp" not in log1


def test_the_torchrun_node_script_asks_for_the_process_count_on_a_cpu_machine(
    tmp_path: Path,
) -> None:
    """Without NPROC_PER_NODE and without nvidia-smi (a CPU machine) the example script says
    what to set and exits 2; it used to end silently with 127 (the missing command under
    ``set -e``)."""
    import shutil

    script = Path(__file__).resolve().parents[1] / "examples" / "multinode" / "torchrun_node.sh"
    bash = shutil.which("bash")
    env = {"PATH": str(tmp_path), "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for tool in ("dirname", "wc"):  # what the script needs before it launches anything
        (tmp_path / tool).symlink_to(shutil.which(tool))
    done = subprocess.run(
        [bash, str(script), "--sp", "1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "no GPU found: set NPROC_PER_NODE" in done.stderr
