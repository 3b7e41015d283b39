"""params.yaml validation: every bad value is a one-line error naming the key; exit code 2 from the CLI."""
from __future__ import annotations

import copy

import pytest
import yaml

from harness import run_job
from modelzoo.errors import UserError
from modelzoo.job.params import load_params, parse_params, with_overrides

VALID = {
    "model": {"checkpoint_path": "ckpt", "start_token": 100, "stop_sequences": [[2], [5, 6]], "max_tokens": 8},
    "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": "data", "batch_size": 4},
    "runconfig": {"inference_steps": 2},
}


def changed(section: str, key: str, value) -> dict:
    raw = copy.deepcopy(VALID)
    raw[section][key] = value
    return raw


def test_valid_params_and_defaults():
    params = parse_params(VALID)
    assert params.model.start_token == (100,)
    assert params.model.stop_sequences == ((2,), (5, 6))
    assert params.model.dtype == "auto" and params.model.loop_dim == 1
    assert params.runconfig.device == "auto" and params.runconfig.compile_only is False
    assert parse_params(changed("model", "start_token", [7, 8])).model.start_token == (7, 8)
    assert parse_params(changed("model", "stop_sequences", [])).model.stop_sequences == ()


@pytest.mark.parametrize("raw, message", [
    (changed("model", "max_token", 3), "unknown key model.'max_token' in params; did you mean 'max_tokens'?"),
    ({**VALID, "runconfg": {}}, "unknown key 'runconfg' in params; did you mean 'runconfig'?"),
    (changed("inference_input", "batch_size", 0), "inference_input.batch_size must be an integer >= 1, got 0"),
    (changed("inference_input", "batch_size", "8"), "inference_input.batch_size must be an integer >= 1, got '8'"),
    (changed("model", "loop_dim", 2), "model.loop_dim must be one of 0, 1, got 2"),
    (changed("model", "stop_sequences", [[2], []]), "model.stop_sequences[1] must be a non-empty list of token ids >= 0, got []"),
    (changed("model", "stop_sequences", [2]), "model.stop_sequences[0] must be a non-empty list of token ids >= 0, got 2"),
    (changed("model", "max_tokens", -1), "model.max_tokens must be an integer >= 1 or null, got -1"),
    (changed("model", "start_token", []), "model.start_token must be an integer >= 0 or a non-empty list of them, got []"),
    (changed("model", "start_token", -3), "model.start_token must be an integer >= 0 or a non-empty list of them, got -3"),
    (changed("model", "dtype", "fp32"), "model.dtype must be one of auto, float32, bfloat16, float16, got 'fp32'"),
    (changed("inference_input", "data_processor", "GptHDF5DataProcessor"),
     "inference_input.data_processor must be one of GptHDF5MapDataProcessor, got 'GptHDF5DataProcessor'"),
    (changed("runconfig", "compile_only", "yes"), "runconfig.compile_only must be true or false, got 'yes'"),
    (changed("runconfig", "device", "tpu"), "runconfig.device must be one of auto, cpu, cuda, got 'tpu'"),
    (changed("model", "min_p", 1.5), "model.min_p must be a number >= 0.0 and <= 1.0, got 1.5"),
    (changed("model", "frequency_penalty", 2.5), "model.frequency_penalty must be a number >= -2.0 and <= 2.0, got 2.5"),
    (changed("model", "min_p", 0.1), "model.top_k, model.top_p and model.min_p only apply when sampling"),
    (changed("runconfig", "decode_step", "graphs"),
     "runconfig.decode_step must be one of auto, eager, compiled, cuda_graph, got 'graphs'"),
    (changed("runconfig", "gemm_backend", "blas"),
     "runconfig.gemm_backend must be one of auto, mkl, onednn, packed, torch, onednn_blocks, torch_blocks, got 'blas'"),
    ({"model": VALID["model"], "runconfig": {}}, "params is missing required key inference_input.data_dir"),
    ({**VALID, "model": {"checkpoint_path": "c"}}, "params is missing required key model.start_token"),
    ([1, 2], "params must be a YAML mapping"),
])
def test_bad_params_are_named(raw, message):
    with pytest.raises(UserError) as error:
        parse_params(raw)
    assert message in str(error.value)


def test_overrides_are_validated_like_yaml():
    params = with_overrides(parse_params(VALID), {"runconfig": {"inference_steps": 5, "device": None}})
    assert params.runconfig.inference_steps == 5 and params.runconfig.device == "auto"
    with pytest.raises(UserError, match="runconfig.inference_steps must be an integer >= 1"):
        with_overrides(params, {"runconfig": {"inference_steps": 0}})


def test_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_params(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(UserError, match="is not valid YAML"):
        load_params(bad)


def test_cli_reports_one_line_and_exit_code_2(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(changed("inference_input", "batch_sise", 4)))
    assert run_job(path, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err == "error: unknown key inference_input.'batch_sise' in params; did you mean 'batch_size'?\n"


def test_every_option_declared_as_a_params_key_is_one_checked_by_its_declared_range():
    """Each GenerationOptions field with `param` is a model: key whose check is its declaration's: a value just
    outside its range is refused with the range in words, its bounds themselves are taken."""
    from modelzoo.generation.options import BOUNDS, PARAM_OPTIONS
    from modelzoo.job.params import SCHEMA

    assert set(PARAM_OPTIONS) <= set(SCHEMA["model"][1])
    for name in PARAM_OPTIONS:
        bound = BOUNDS.get(name)
        if bound is None:
            continue
        below = bound.low if bound.open_low else bound.low - 1
        with pytest.raises(UserError, match=f"model.{name} must be {bound.text()}"):
            parse_params(changed("model", name, below))
        inside = bound.low + 1 if bound.open_low else bound.low
        inside = min(inside, bound.high)
        assert getattr(parse_params(changed("model", name, inside if bound.integer else float(inside))).model,
                       name) == inside


def test_backend_choices_are_the_engines_own():
    """params.py names the GEMM and int8 backends without importing torch: the same names as the modules that run
    them, so a backend added there cannot be refused here."""
    from modelzoo.cpu.gemm import BACKENDS
    from modelzoo.cpu.int8_compute import INT8_BACKENDS
    from modelzoo.job import params

    assert params.GEMM_BACKENDS == ("auto", *BACKENDS)
    assert params.INT8_BACKENDS == ("auto", *INT8_BACKENDS)
