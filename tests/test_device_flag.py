"""A device the machine lacks (``--device cuda`` without a GPU) or one that is no device
(``--device gpu``) is bad input: one line and status 2 at the command line, a ``ValueError``
from the Python API, never a traceback from deep inside ``model.to(...)``
(:func:`dspzoo.zoo.pretrained.check_device`)."""

from __future__ import annotations

import pytest
import torch
from test_cli_messages import _cli

from dspzoo.zoo import inference
from dspzoo.zoo.pretrained import check_device, from_pretrained

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _one_line_status_2(args: list[str]) -> str:
    proc = _cli(args, {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


@NO_CUDA
def test_generate_device_cuda_without_cuda_is_one_line_with_status_2() -> None:
    err = _one_line_status_2(
        ["generate", "bytelm-tiny-stdlib", "--prompt", "def ", "--device", "cuda"]
    )
    assert err.startswith(
        "dspzoo generate bytelm-tiny-stdlib: error: --device cuda: this PyTorch has no CUDA "
        "device (torch.cuda.is_available() is False"
    ), err
    assert "; use --device cpu" in err


def test_generate_device_gpu_is_one_line_with_status_2() -> None:
    err = _one_line_status_2(["generate", "bytelm-tiny-stdlib", "--device", "gpu"])
    assert err.startswith(
        "dspzoo generate bytelm-tiny-stdlib: error: --device gpu: not a device a dspzoo model "
        "runs on (this machine has cpu"
    ), err
    assert "; use --device " in err


@pytest.mark.parametrize(
    "command",
    [
        ["sample", "stdit-mini-shapes"],
        ["predict", "evoformer-small-pdb", "--fasta", "query.fasta"],
        ["forecast", "weathertx-small-a1b-e1"],
    ],
)
def test_commands_without_a_device_flag_refuse_it_in_one_line(command) -> None:
    """``sample``, ``predict`` and ``forecast`` run on the accelerator's device (a GPU where
    there is one) and take no ``--device``: given one, they say so in one line."""
    err = _one_line_status_2([*command, "--device", "cuda"])
    assert f"dspzoo {command[0]} {command[1]}: error: unrecognized arguments: --device cuda" in err


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_api_refuses_cuda_without_cuda(device) -> None:
    match = r"^device='cuda(:\d)?': this PyTorch has no CUDA device .*; use device='cpu'$"
    with pytest.raises(ValueError, match=match):
        from_pretrained("bytelm-tiny-stdlib", device=device)
    with pytest.raises(ValueError, match=match):
        inference.load("bytelm-tiny-stdlib", inference.TEXT_FAMILIES, device)


@pytest.mark.parametrize("device", ["gpu", "meta", "cuda:x", ""])
def test_api_refuses_what_is_not_a_device(device) -> None:
    match = rf"^device={device!r}: not a device a dspzoo model runs on \(this machine has cpu"
    with pytest.raises(ValueError, match=match):
        from_pretrained("bytelm-tiny-stdlib", device=device)
    with pytest.raises(ValueError, match=match):
        inference.load("bytelm-tiny-stdlib", device=device)


def test_the_device_is_checked_before_the_model_is_looked_up() -> None:
    with pytest.raises(ValueError, match="^device='gpu'"):
        inference.load("no-such-model", device="gpu")
    with pytest.raises(ValueError, match="^device='gpu'"):
        from_pretrained("no-such-model", device="gpu")


def test_cpu_and_available_devices_pass() -> None:
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(None) == torch.device("cpu")
    assert check_device(torch.device("cpu"), flag="--device") == torch.device("cpu")
    loaded = inference.load("bytelm-tiny-stdlib", device="cpu")
    assert loaded.device == torch.device("cpu")


def test_a_cuda_index_past_the_last_gpu_and_a_missing_mps(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert check_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError) as info:
        check_device("cuda:2", flag="--device")
    assert str(info.value) == (
        "--device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1; use --device cuda:0"
    )
    with pytest.raises(ValueError) as info:
        check_device("mps")
    assert str(info.value) == (
        "device='mps': this PyTorch has no MPS device (torch.backends.mps.is_available() is "
        "False); use device='cuda'"
    )
    with pytest.raises(ValueError, match=r"^--device gpu: .*; use --device cuda$"):
        check_device("gpu", flag="--device")
