"""What the CUDA cases of the tests share: the skip mark and the device parameter.

The suite runs on CPUs (CI); on a machine with a CUDA device the cases marked here run too
(``scripts/gpu_checks.sh``, docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

#: skips a test where no CUDA device is visible
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: ``@pytest.mark.parametrize("device", DEVICES)``: the CPU always, CUDA where there is one
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
