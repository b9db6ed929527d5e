"""The tooling around the ops: the benchmark command line's refusals, setup.py's build switches,
the native loader's errors and `python -m fusedops`'s build lines, self-check and quick
benchmark. Fast: nothing is built or timed."""

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedops
from fusedops import _native

ROOT = Path(__file__).resolve().parents[1]


# ---- benchmarks/run.py ----------------------------------------------------------------------


@pytest.fixture
def bench():
    """benchmarks.run, imported as `python -m benchmarks.run` would (a checkout only: the sdist
    ships tests/ without benchmarks/)."""
    if not (ROOT / "benchmarks" / "run.py").is_file():
        pytest.skip("benchmarks/ is not beside tests/ (not a checkout)")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import run

    return run


@pytest.fixture
def old_results(tmp_path):
    """A results directory holding results from an earlier run, which a failed run must keep."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("op,mode,shape\nrms_norm,fwd,16x4096\n")
    return out


@pytest.mark.parametrize(
    "filters, named",
    [
        (["--ops", "rms_norm", "--providers", "fusedop"], "--providers fusedop"),  # a typo
        (["--ops", "rms_norm", "--providers", "eager,fusedops-cuda"], "--providers fusedops-cuda"),
        (["--ops", "cross_entropy", "--modes", "bwd"], "--modes bwd"),  # (it has fwd and fwd+bwd)
        (["--ops", "rms_norm", "--providers", "fusedops-raw", "--modes", "fwd,bwd"], "--modes bwd"),
        (["--ops", "rms_norm", "--shapes", "wide"], "--shapes wide"),  # (no wide case on the CPU)
    ],
)
def test_bench_filter_selecting_nothing_is_an_error_before_anything_is_written(
    bench, old_results, capsys, filters, named
):
    before = (old_results / "results.csv").read_text()
    rc = bench.main(["--device", "cpu", "--quick", "--no-plot", "--out", str(old_results), *filters])
    err = capsys.readouterr().err
    assert rc == 2
    assert named in err and "left as it was" in err
    assert (old_results / "results.csv").read_text() == before
    assert sorted(p.name for p in old_results.iterdir()) == ["results.csv"]


def test_bench_run_without_rows_never_replaces_results(bench, old_results):
    from benchmarks import harness

    before = (old_results / "results.csv").read_text()
    assert harness.save_results(old_results, [], {"run_id": "x"}, append=False) is None
    assert (old_results / "results.csv").read_text() == before


def test_bench_report_marks_ratios_across_sessions(bench):
    """A table's ratio between rows of two runs started hours apart (or on other machines) is
    marked with a dagger, and each row names its run; rows of one session compare unmarked."""
    from benchmarks import harness

    def row(provider, role, run_id, ms, device_name="GPU A"):
        return dict(op="rms_norm", mode="fwd", shape="16x4096", dtype="bf16", size="small", provider=provider,
                    role=role, status="ok", time_ms=str(ms), time_ms_p20=str(ms), time_ms_p80=str(ms),
                    wall_us="", tbps="1", pct_copy="50", device="cpu", device_name=device_name, run_id=run_id)

    runs = [{"run_id": "a", "date": "2026-12-01T10:00:00+00:00"},
            {"run_id": "b", "date": "2026-12-01T10:20:00+00:00"},
            {"run_id": "c", "date": "2026-12-01T14:00:00+00:00"}]
    rows = [row("eager", "peer", "a", 2.0), row("torch.compile", "peer", "c", 3.0),
            row("fusedops-cpu", "subject", "b", 1.0)]
    table = harness.render_markdown(rows, runs, {})
    line = next(x for x in table.splitlines() if "**fusedops-cpu**" in x)
    assert line.split(" | ")[3] == "r2"
    assert line.endswith("| 2.00 | 3.00 † |"), line
    other_machine = [row("eager", "peer", "a", 2.0, "GPU B"), row("fusedops-cpu", "subject", "b", 1.0)]
    line = next(x for x in harness.render_markdown(other_machine, runs, {}).splitlines() if "**fusedops" in x)
    assert line.endswith("| 2.00 † |"), line


def test_bench_merge_needs_out(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--merge", str(tmp_path)])
    assert exc.value.code == 2
    assert "--merge needs --out" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["missing", "empty dir", "header only"])
def test_bench_merge_of_a_directory_without_results_is_an_error(bench, tmp_path, capsys, source):
    src = tmp_path / "src"
    if source != "missing":
        src.mkdir()
    if source == "header only":
        (src / "results.csv").write_text("op,mode,shape\n")
    out = tmp_path / "out"
    assert bench.main(["--merge", str(src), "--out", str(out), "--no-plot"]) == 2
    assert f"--merge {src}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_bench_report_only_for_cuda_without_a_gpu_asks_for_out(bench, capsys):
    assert bench.main(["--device", "cuda", "--report-only", "--no-plot"]) == 2
    assert "pass --out DIR" in capsys.readouterr().err


# ---- setup.py ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup_py():
    """setup.py's helpers; its setup() call runs only as __main__, so importing builds nothing."""
    spec = importlib.util.spec_from_file_location("fusedops_setup_py", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "spec, cmake",
    [
        ("9.0", "90-real"),
        ("8.0;9.0+PTX", "80-real;90"),
        ("8.0 8.6  9.0", "80-real;86-real;90-real"),
        ("9.0a", "90a-real"),
        ("9.0a+PTX", "90a"),
        ("8.0;8.6;8.9;9.0;10.0;12.0+PTX", "80-real;86-real;89-real;90-real;100-real;120"),
    ],
)
def test_setup_arch_list_accepted_forms(setup_py, spec, cmake):
    assert setup_py._cmake_archs(spec) == cmake


@pytest.mark.parametrize("spec", ["90", "sm_90", "Hopper", "12.0f", "9.0;sm_90", "9.0+ptx", "9", ";"])
def test_setup_arch_list_rejects_other_forms_naming_the_accepted_ones(setup_py, spec):
    with pytest.raises(RuntimeError, match="TORCH_CUDA_ARCH_LIST") as exc:
        setup_py._cmake_archs(spec)
    if spec != ";":
        assert '"9.0+PTX"' in str(exc.value) and '"9.0a"' in str(exc.value)


@pytest.mark.parametrize("item", ["9.0", "9.0a", "9.0+PTX", "9.0a+PTX", "12.0", "90", "sm_90", "12.0f",
                                  "9.0+ptx"])
def test_setup_and_the_runtime_check_read_the_same_arch_forms(setup_py, item):
    """A list setup.py accepts is recorded in the build record, where _native.archs_cover must
    read it at import time to tell whether a GPU has code."""
    assert setup_py.ARCH_ITEM.pattern == _native.ARCH_ITEM.pattern
    try:
        setup_py._cmake_archs(item)
        accepted = True
    except RuntimeError:
        accepted = False
    assert accepted == (_native.ARCH_ITEM.fullmatch(item) is not None)
    if accepted:
        major, minor = (int(v) for v in _native.ARCH_ITEM.fullmatch(item).groups()[:2])
        assert _native.archs_cover(item, (major, minor))


@pytest.mark.parametrize("value, mode", [(None, "auto"), ("", "auto"), (" auto ", "auto"), ("AUTO", "auto"),
                                         ("0", "0"), ("1", "1")])
def test_setup_fusedops_cuda_accepted_values(setup_py, monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("FUSEDOPS_CUDA", raising=False)
    else:
        monkeypatch.setenv("FUSEDOPS_CUDA", value)
    assert setup_py._cuda_mode() == mode


@pytest.mark.parametrize("value", ["yes", "ON", "true", "cuda", "2"])
def test_setup_fusedops_cuda_rejects_other_values(setup_py, monkeypatch, value):
    monkeypatch.setenv("FUSEDOPS_CUDA", value)
    with pytest.raises(RuntimeError, match=f"FUSEDOPS_CUDA must be one of auto, 0, 1 .*got '{value}'"):
        setup_py._cuda_mode()


def test_setup_records_the_compiler_from_the_cmake_cache(setup_py, tmp_path):
    assert setup_py._cmake_cxx_compiler(tmp_path) == ""  # (not configured)
    (tmp_path / "CMakeCache.txt").write_text(
        "CMAKE_CXX_FLAGS:STRING=\n"
        "CMAKE_CXX_COMPILER:FILEPATH=/opt/gcc/bin/g++\n"
        "CMAKE_C_COMPILER:FILEPATH=/usr/bin/cc\n"
    )
    assert setup_py._cmake_cxx_compiler(tmp_path) == "/opt/gcc/bin/g++"
    # (any program answers --version; the interpreter is one that is surely here)
    assert setup_py._first_version_line(sys.executable).startswith("Python 3.")
    assert setup_py._first_version_line(str(tmp_path / "no-such-compiler")) == ""


def test_setup_writes_the_checkouts_build_record_only_for_builds_into_it(setup_py, tmp_path, monkeypatch):
    """A wheel built from a checkout (pip install ., pip wheel .) writes its build record beside
    its own libraries only, not over src/fusedops/_build_info.py, which describes the libraries
    an editable install put in the checkout; an editable (in-place) build writes both."""
    from setuptools import Distribution

    monkeypatch.setattr(setup_py, "ROOT", tmp_path)
    source, built = tmp_path / "src" / "fusedops", tmp_path / "build" / "lib" / "fusedops"
    source.mkdir(parents=True)
    built.mkdir(parents=True)
    for into_source in (False, True):
        for d in (source, built):
            (d / "_build_info.py").write_text("BUILD_INFO = 'before'\n")
        command = setup_py.CMakeBuild(Distribution({"name": "fusedops"}))
        command.get_ext_fullpath = lambda name: str(built / "_C.abi3.so")
        command.into_source = into_source
        command._write_build_info(torch, False, None, "", "Release", tmp_path)
        assert "'torch_target': '2.10'" in (built / "_build_info.py").read_text()
        assert ("'torch_target': '2.10'" in (source / "_build_info.py").read_text()) == into_source


# ---- the native loader --------------------------------------------------------------------------


def test_native_missing_library_gets_the_build_error_with_a_fix(monkeypatch):
    info = dict(_native.build_info(), torch_cuda="13.0", cuda_built=True, cuda_archs="9.0")
    monkeypatch.setattr(_native, "build_info", lambda: info)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("FUSEDOPS_BACKEND", "auto")
    real_import = _native.importlib.import_module

    def import_module(name, *args):
        if name == "fusedops._C_cuda":  # (as where the build record outlived the library)
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(_native.importlib, "import_module", import_module)
    with pytest.raises(_native.IncompatibleBuildError, match="fusedops._C_cuda") as exc:
        _native._load()
    message = str(exc.value)
    assert "pip install --no-build-isolation ." in message and "FUSEDOPS_BACKEND=triton" in message
    assert isinstance(exc.value.__cause__, ModuleNotFoundError)


def test_native_unloadable_cpu_library_gets_the_build_error(monkeypatch):
    def import_module(name, *args):
        raise ImportError("undefined symbol: something")

    monkeypatch.setattr(_native.importlib, "import_module", import_module)
    with pytest.raises(_native.IncompatibleBuildError, match=r"fusedops._C .*undefined symbol") as exc:
        _native._import_native("fusedops._C", "the schemas and CPU kernels", _native.build_info())
    assert isinstance(exc.value.__cause__, ImportError)


# ---- python -m fusedops -------------------------------------------------------------------------


@pytest.mark.parametrize("torch_cuda, cuda_built, expected", [
    (None, False, "not built; this torch has no CUDA, so only the CPU kernels apply"),
    ("13.0", False, "not built (CUDA tensors use the Triton kernels)"),
    (None, True, "unused here: this torch has no CUDA"),
])
def test_main_says_what_serves_cuda_tensors(monkeypatch, capsys, torch_cuda, cuda_built, expected):
    from fusedops import __main__ as cli

    info = dict(fusedops.build_info(), cuda_built=cuda_built, torch_cuda="13.0" if cuda_built else "",
                cuda_compiler="13.0" if cuda_built else "", cuda_archs="9.0" if cuda_built else "",
                cxx_compiler="g++ (GCC) 12.2.0", cxx_compiler_path="/usr/bin/g++")
    monkeypatch.setattr(cli.fusedops, "build_info", lambda: info)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cli._print_build()
    out = capsys.readouterr().out
    assert expected in out
    assert "g++ (GCC) 12.2.0 (/usr/bin/g++)" in out


def _one_small_sample(info):
    """`info` cut to its first float32 sample, so that the self-check runs in a moment."""
    def samples(device, dtype, requires_grad=False, edge=True):
        yield next(iter(info.samples(device, dtype, requires_grad=requires_grad, edge=False)))

    return dataclasses.replace(info, samples=samples, dtypes=(torch.float32,))


def test_main_self_check_covers_the_in_place_forms(monkeypatch, capsys):
    from fusedops import __main__ as cli
    from fusedops.testing import OP_TESTS_BY_NAME, PublicVariant

    info = _one_small_sample(OP_TESTS_BY_NAME["add_rms_norm"])
    (inplace,) = info.public_variants
    # (a broken in-place form: returns the right output but leaves the residual unchanged)
    broken = PublicVariant("add_rms_norm_", lambda x, r, *a: (inplace.call(x, r, *a)[0], r))
    monkeypatch.setattr(cli, "_devices", lambda: ["cpu"])
    monkeypatch.setattr(cli, "OP_TESTS", [info])
    assert cli._self_check()
    assert "add_rms_norm_" in capsys.readouterr().out
    monkeypatch.setattr(cli, "OP_TESTS", [dataclasses.replace(info, public_variants=(broken,))])
    assert not cli._self_check()
    out = capsys.readouterr().out
    assert "add_rms_norm " in out and "add_rms_norm_ " in out
    assert [line.split()[0] for line in out.splitlines() if "FAILED" in line] == ["add_rms_norm_"]


def test_main_self_check_fails_a_wrong_dtype_under_python_O():
    """The self-check's structural checks (output count, dtype, shape) hold under `python -O`,
    which strips `assert` statements: an op returning float32 for bf16 input fails there too."""
    import textwrap

    script = textwrap.dedent("""
        import dataclasses, sys
        from fusedops import __main__ as cli
        from fusedops.testing import OP_TESTS_BY_NAME
        info = OP_TESTS_BY_NAME["rms_norm"]
        wrong = dataclasses.replace(info, public=lambda *a: info.public(*a).float(), public_variants=())
        cli._devices = lambda: ["cpu"]
        cli.OP_TESTS = [wrong]
        sys.exit(0 if cli._self_check() else 3)
    """)
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    assert "dtype torch.float32" in done.stdout


def test_main_benchmark_reports_a_raising_op_and_goes_on(monkeypatch, capsys):
    from fusedops import __main__ as cli
    from fusedops.testing import OP_TESTS_BY_NAME

    def boom(*args):
        raise RuntimeError("kernel refused\nsecond line")

    failing = dataclasses.replace(OP_TESTS_BY_NAME["swiglu"], name="failing", public=boom)
    monkeypatch.setattr(cli, "_devices", lambda: ["cpu"])
    monkeypatch.setattr(cli, "_time_call", lambda fn: (fn(), 1e-3)[1])
    monkeypatch.setattr(cli, "OP_TESTS", [failing, OP_TESTS_BY_NAME["swiglu"]])
    assert not cli._benchmark()
    rows = capsys.readouterr().out.splitlines()
    assert sum("failing" in r and "FAILED: RuntimeError: kernel refused" in r for r in rows) == 2  # fp32, bf16
    assert sum(r.split()[:1] == ["swiglu"] and r.endswith(tuple("0123456789")) for r in rows) == 2


@pytest.mark.parametrize("label", ["fusedops-cpu-raw", "fusedops-cpu+offset", "fusedops+offset", "fusedops-raw"])
def test_bench_providers_takes_the_labels_of_fusedops_forms(bench, label):
    """A label names its provider alone, with the backend where the results show it."""
    from benchmarks import harness

    entry = bench.load_entries()["rms_norm"]
    settings = harness.Settings(device="cpu", providers=[label])
    plan = harness.plan_run([entry], settings)
    assert plan.unmatched_providers == [] and plan.rows > 0
    (chosen,) = harness.select_providers(entry, settings)
    expected = label if label.startswith("fusedops-cpu") else label.replace("fusedops", "fusedops-cpu", 1)
    if label == "fusedops-raw":
        expected = "fusedops-cpu-raw"
    assert chosen[1].label == expected


def test_bench_backward_failure_fails_only_the_modes_running_it(bench):
    """A provider whose backward raises: fwd is timed, bwd and fwd+bwd are errors naming it."""
    from benchmarks import harness

    class ForwardOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up):
            return torch.nn.functional.silu(gate) * up

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("no backward here")

    entry = bench.load_entries()["swiglu"]
    broken = harness.Provider("broken", lambda device: harness.Probe("broken", True),
                              lambda case, device: ForwardOnly.apply)
    entry = dataclasses.replace(entry, providers=[broken], cpu_cases=entry.cpu_cases[:1])
    settings = harness.Settings(device="cpu", providers=["broken"], quick=True)
    rows = harness.run_entry(entry, settings, {"run_id": "test", "copy_tbps": 1.0})
    status = {r["mode"]: (r["status"], r["note"]) for r in rows}
    assert status["fwd"][0] == "ok"
    for mode in ("bwd", "fwd+bwd"):
        assert status[mode][0] == "error" and "backward: RuntimeError: no backward here" in status[mode][1]


def test_bench_run_of_skipped_rows_only_keeps_the_results(bench, old_results, monkeypatch, capsys):
    from benchmarks import harness

    before = (old_results / "results.csv").read_text()
    entry = bench.load_entries()["swiglu"]
    absent = harness.Provider("absent", lambda device: harness.Probe("absent", False, "not installed"),
                              lambda case, device: None)
    monkeypatch.setattr(bench, "load_entries", lambda: {"swiglu": dataclasses.replace(entry, providers=[absent])})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda device: {"copy_tbps": 1.0, "copy_bytes": 2**20})
    rc = bench.main(["--device", "cpu", "--quick", "--no-plot", "--out", str(old_results), "--providers", "absent"])
    assert rc == 1
    assert "every row was skipped (absent: not installed)" in capsys.readouterr().err
    assert (old_results / "results.csv").read_text() == before


@pytest.mark.parametrize("threads", ["0", "-1", "two"])
def test_bench_threads_must_be_positive(bench, capsys, threads):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--threads", threads])
    assert exc.value.code == 2
    assert f"--threads: {threads!r} is not a positive whole number" in capsys.readouterr().err


def test_bench_fusedops_backends_are_checked(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--fusedops-backends", "cuda,trition"])
    assert exc.value.code == 2
    assert "--fusedops-backends: unknown backend(s) ['trition']" in capsys.readouterr().err
    assert bench.parse_args(["--fusedops-backends", "default,triton"]).fusedops_backends == ["default", "triton"]


# ---- benchmarks/candidates/ -------------------------------------------------------------------


def _candidate_patches():
    return sorted((ROOT / "benchmarks" / "candidates").glob("*.patch"))


@pytest.mark.parametrize("patch", _candidate_patches(), ids=lambda p: p.name)
def test_candidate_patch_still_applies(patch):
    """A kernel change kept for a later measurement must still apply to the tree, or the session
    that can measure it would first have to redo it."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout with git on PATH (the sdist's tests/)")
    done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr}"


def _header_fields(text, name):
    header = text.split("\ndiff --git ", 1)[0]
    return [line[len(name) + 2:] for line in header.splitlines() if line.startswith(name + ": ")]


@pytest.mark.parametrize("patch", _candidate_patches(), ids=lambda p: p.name)
def test_candidate_patch_has_what_measure_sh_needs(patch):
    """benchmarks/candidates/measure.sh times a candidate with its `ab-command:` lines and tests it
    with its `gpu-tests:` selection, running every build under this tree's Python."""
    text = patch.read_text()
    commands = _header_fields(text, "ab-command")
    assert commands and all(c.startswith("python3 benchmarks/") for c in commands), commands
    for command in commands:
        assert (ROOT / command.split()[1]).is_file(), f"{patch.name}: no {command.split()[1]}"
    assert len(_header_fields(text, "gpu-tests")) == 1, f"{patch.name}: needs one gpu-tests: line"
    touched = [line.split()[2][2:] for line in text.splitlines() if line.startswith("diff --git ")]
    assert touched and all(path.startswith(("csrc/", "tests/")) for path in touched), touched


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").rglob("*.sh")), ids=lambda p: p.name)
def test_benchmark_shell_scripts_parse(script):
    """The GPU-machine scripts run only there, where a syntax error costs a call: bash -n here."""
    if shutil.which("bash") is None:
        pytest.skip("no bash on PATH")
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
