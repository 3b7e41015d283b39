"""The SDPA backend choice of a CUDA job (modelzoo/cuda/attention_backends.py): nothing pinned on the CPU; on a
GPU timed once per GPU model, software, head layout, dtype and rows, remembered, and read back by the next job.
The timing itself needs a GPU (tests/test_cuda.py runs it); here it is replaced by a recorder."""
from __future__ import annotations

import json

import pytest
import torch

from modelzoo.cuda import attention_backends as ab
from modelzoo.cpu.kernels import machine_dir


def choices_file():
    return machine_dir() / ab.SDPA_CHOICES


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A kernel folder of the test's own and a GPU that names itself; returns the calls to the timer."""
    monkeypatch.setenv("ZOO_INFER_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    calls = []

    def timer(*args):
        calls.append(args)
        return ab.AttentionBackends("flash", "efficient", {"prefill": {"flash": 1.0}, "decode": {"efficient": 2.0}})

    monkeypatch.setattr(ab, "time_attention_backends", timer)
    return calls


def test_nothing_is_pinned_on_the_cpu():
    choice = ab.choose_attention_backends(4, 2, 16, torch.float32, torch.device("cpu"), 8)
    assert (choice.prefill, choice.decode) == (None, None)
    with choice.prefill_context(), choice.decode_context():  # no-ops
        assert torch.backends.cuda.math_sdp_enabled()


def test_a_choice_is_timed_once_then_read_back(fake_gpu):
    cuda = torch.device("cuda")
    first = ab.choose_attention_backends(32, 4, 64, torch.bfloat16, cuda, 256)
    assert (first.prefill, first.decode) == ("flash", "efficient") and len(fake_gpu) == 1
    stored = json.loads(choices_file().read_text())["shapes"]
    key = ab.choice_key("Test GPU", (9, 0), 32, 4, 64, torch.bfloat16, 256)
    assert stored == {key: {"prefill": "flash", "decode": "efficient",
                            "timings": {"prefill": {"flash": 1.0}, "decode": {"efficient": 2.0}}}}
    again = ab.choose_attention_backends(32, 4, 64, torch.bfloat16, cuda, 256)
    assert again == first and len(fake_gpu) == 1  # read back, not timed
    ab.choose_attention_backends(32, 4, 64, torch.bfloat16, cuda, 1024)  # other rows: timed
    ab.choose_attention_backends(32, 4, 64, torch.float32, cuda, 256)  # another dtype: timed
    assert len(fake_gpu) == 3 and len(json.loads(choices_file().read_text())["shapes"]) == 3


def test_an_unreadable_choices_file_is_timed_again(fake_gpu):
    choices_file().parent.mkdir(parents=True)
    choices_file().write_text("{not json")
    choice = ab.choose_attention_backends(8, 8, 32, torch.bfloat16, torch.device("cuda"), 16)
    assert choice.decode == "efficient" and len(fake_gpu) == 1
    assert len(json.loads(choices_file().read_text())["shapes"]) == 1  # rewritten whole


def test_the_pinned_backend_keeps_math_behind_it():
    """A call the pinned backend cannot take (an ALiBi bias under flash, say) still runs, on the math path."""
    with ab.AttentionBackends(prefill="flash").prefill_context():
        assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
        q = torch.randn(1, 2, 3, 8)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 2, 3, 3))
        assert out.shape == q.shape
    assert torch.backends.cuda.mem_efficient_sdp_enabled()  # restored

