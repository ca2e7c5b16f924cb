"""Issue 19, item 8: messages that lead somewhere, and one rule for the mode a loaded model is in.

A missing ``--resume`` folder is named as the user gave it; ``--data`` naming a missing weather
file says so before asking for variables; ``from_pretrained`` returns eval mode on every path.
(The corrupt-video message naming ``--on-bad-video skip``: tests/test_video_data.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dspzoo.core.train.resume import find_checkpoint
from dspzoo.domains.weather.data import WeatherDataError
from dspzoo.domains.weather.training import WeatherTrainConfig
from dspzoo.zoo import create_model, from_pretrained, save_pretrained, shipped_names

REPO = Path(__file__).resolve().parents[1]


def test_a_missing_resume_folder_is_the_one_the_user_gave(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    given = tmp_path / "elsewhere" / "step_40"
    with pytest.raises(FileNotFoundError) as caught:
        find_checkpoint(str(given), ckpt_dir)
    message = str(caught.value)
    assert message.startswith(f"--resume {given}: no checkpoint folder {given.resolve()}")
    assert "--resume latest" in message  # the way on
    with pytest.raises(FileNotFoundError, match="no checkpoint") as caught:
        find_checkpoint("latest", ckpt_dir)
    assert str(caught.value) == f"--resume latest: no checkpoint in {ckpt_dir}"


def test_weather_data_names_the_missing_file_before_asking_for_variables(tmp_path: Path) -> None:
    missing = tmp_path / "nosuch.nc"
    with pytest.raises(FileNotFoundError, match=f"weather data file {missing} does not exist"):
        WeatherTrainConfig(data=str(missing)).channel_variables()
    present = tmp_path / "fields.nc"
    present.write_bytes(b"CDF\x01")  # exists: now the variables are what is missing
    with pytest.raises(WeatherDataError, match="--variables"):
        WeatherTrainConfig(data=str(present)).channel_variables()
    assert WeatherTrainConfig(data=str(present), variables="t2m").channel_variables() == ("t2m",)


def test_weather_cli_names_the_missing_file(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "dspzoo", "train", "weather", "--sp", "1", "--data", "nosuch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "weather data file nosuch does not exist" in run.stderr, run.stderr
    assert "--variables" not in run.stderr


def test_from_pretrained_returns_eval_mode_and_create_model_train_mode(tmp_path: Path) -> None:
    fresh = create_model("weathertx-tiny", dropout=0.1)
    assert fresh.training and all(m.training for m in fresh.modules())
    folder = save_pretrained(fresh, tmp_path / "w")
    assert fresh.training  # saving does not change the caller's model
    loaded = from_pretrained(folder)
    assert not any(m.training for m in loaded.modules())
    name = shipped_names()[0]  # the shipped-name path too
    assert not any(m.training for m in from_pretrained(name).modules())
