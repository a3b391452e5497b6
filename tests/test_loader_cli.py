"""Model-file contract and CLI errors: one clear line, exit code 2, nothing written."""

import subprocess
import sys
from pathlib import Path

import pytest

from advisor.errors import ModelFileError
from advisor.loader import load_model_file, parse_shapes

GOOD = """
import torch
def build_model(device, dtype):
    return torch.nn.Linear(8, 8).to(device=device, dtype=dtype)
def make_inputs(seq_len, batch, device):
    return (torch.randn(batch, seq_len, 8, device=device),)
"""

BAD = {
    "syntax": ("def build_model(:\n", "syntax error"),
    "import": ("import not_a_module_xyz\n", "import failed: ModuleNotFoundError"),
    "missing": ("def build_model(device, dtype):\n    pass\n", "missing function make_inputs"),
    "forward": (GOOD.replace("return torch.nn.Linear(8, 8)", "return torch.nn.Linear(9, 8)"),
                "forward failed: RuntimeError"),
    "build": (GOOD.replace("return torch.nn.Linear(8, 8).to(device=device, dtype=dtype)",
                           "raise ValueError('no weights')"), "build_model failed: ValueError: no weights"),
}


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_model_files_give_one_line_and_exit_2(tmp_path, case):
    source, expected = BAD[case]
    model = tmp_path / "model.py"
    model.write_text(source)
    out_json = tmp_path / "out.json"
    proc = _run("analyze", str(model), "--shapes", "4", "--device", "cpu", "--json", str(out_json),
                "--iters", "1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0] and "model.py" in lines[0], proc.stderr
    assert not out_json.exists()


def test_missing_file_and_bad_flags(tmp_path):
    proc = _run("analyze", str(tmp_path / "nope.py"), "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 2 and "no such model file" in proc.stderr
    (tmp_path / "m.py").write_text(GOOD)
    proc = _run("analyze", str(tmp_path / "m.py"), "--shapes", "a,b", "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 2 and "--shapes" in proc.stderr
    proc = _run("analyze", str(tmp_path / "m.py"), "--dtype", "int3", "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown dtype" in proc.stderr


@pytest.mark.parametrize("args", [("analyze",), ("nosuchcommand",), ("analyze", "m.py", "--no-such-flag"),
                                  ("bench", "m.py", "--batch", "0")])
def test_usage_errors_are_a_usage_line_and_exit_2(tmp_path, args, cli):
    """Click's usage errors, whichever click raises them (typer bundles its own copy)."""
    (tmp_path / "m.py").write_text(GOOD)
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Error:" in proc.stderr, proc.stderr


def test_bad_compile_mode_and_output_path_fail_before_the_run(tmp_path, cli):
    """Not after minutes of measuring: the mode is checked against torch.compile's, the
    output's folder for being one that can be written."""
    (tmp_path / "m.py").write_text(GOOD)
    (tmp_path / "file").write_text("")
    proc = cli("bench", "m.py", "--device", "cpu", "--compile", "default,bogus", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown torch.compile mode(s) ['bogus']" in proc.stderr, proc.stderr
    for flag in ("--json", "--trace"):
        proc = cli("analyze", "m.py", "--device", "cpu", flag, "file/x", cwd=tmp_path)
        assert proc.returncode == 2 and "is not a folder" in proc.stderr, proc.stderr
    proc = cli("analyze", "m.py", "--device", "cpu", "--json", ".", cwd=tmp_path)
    assert proc.returncode == 2 and "is a folder" in proc.stderr, proc.stderr


def test_ctrl_c_exits_130(monkeypatch, capsys):
    """click hands an interrupt back as a return code outside standalone mode."""
    import advisor.loader
    from advisor.cli import main

    def interrupted(text):
        raise KeyboardInterrupt
    monkeypatch.setattr(advisor.loader, "parse_shapes", interrupted)
    monkeypatch.setattr(sys, "argv", ["advisor", "analyze", "examples/tiny_llama.py", "--device", "cpu"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 130 and "aborted" in capsys.readouterr().err


def test_parse_shapes():
    assert parse_shapes("512, 128,2048,128") == (128, 512, 2048)
    with pytest.raises(ModelFileError):
        parse_shapes("0,4")


def test_load_good_file(tmp_path):
    (tmp_path / "m.py").write_text(GOOD)
    mf = load_model_file(tmp_path / "m.py")
    assert mf.make_decode_inputs is None and len(mf.sha256) == 64


@pytest.mark.parametrize("path", ["examples/tiny_llama.py", "examples/llama_hf.py", "examples/gpt2_hf.py"])
def test_example_model_files_build_and_run_tiny(path):
    """Every example is a model file the loader takes: tiny on the CPU, logits per token."""
    import torch

    from advisor.loader import build, call, first_tensor, inputs_for

    mf = load_model_file(Path(__file__).resolve().parents[1] / path)
    model = build(mf, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = first_tensor(call(model, inputs_for(mf, 5, 2, torch.device("cpu"))))
    assert out.shape[:2] == (2, 5) and torch.isfinite(out).all()
