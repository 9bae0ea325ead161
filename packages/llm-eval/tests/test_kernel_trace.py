"""The reading of Nsight Compute's CSV log (the device machine runs ncu; CI has none)."""

from pathlib import Path

import pytest
from llm_eval import kernel_trace

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
    '"Metric Value"'
)


def row(i, name, value, unit="ns", metric=kernel_trace.METRIC):
    return (
        f'"{i}","7","python3","h","{name}","1","13","(256, 1, 1)","({i + 1}, 1, 1)","0","9.0",'
        f'"Command line profiler metrics","{metric}","{unit}","{value}"'
    )


@pytest.mark.parametrize(
    ("demangled", "short"),
    [
        (
            "void mlx::core::cu::rms_norm<__nv_bfloat16, 4, 1024>(const T1 *, T1 *, int)",
            "rms_norm<__nv_bfloat16, 4, 1024>",
        ),
        ("void attention_step_kernel(Params)", "attention_step_kernel"),
        (
            "void mlx::core::cu::(anonymous namespace)::copy_gg<float, int>(const T1 *, T1 *)",
            "copy_gg<float, int>",
        ),
        ("cutlass::Kernel2<Gemm<a::b<1>, 3>>(Gemm::Params)", "Kernel2<Gemm<a::b<1>, 3>>"),
    ],
)
def test_short_names_keep_the_function_and_its_template_arguments(demangled, short):
    assert kernel_trace.short_name(demangled) == short


def test_log_rows_become_kernels_in_launch_order_and_steps_sum(tmp_path):
    log = tmp_path / "ncu.csv"
    lines = [
        "==PROF== Connected to process 7",
        HEADER,
        # IDs out of order, a thousands separator, another unit, another metric skipped
        row(2, "void b(int)", "1,500"),
        row(0, "void a(int)", "1", unit="usecond"),
        row(1, "void b(int)", "2", unit="us"),
        row(3, "void a(int)", "3000"),
        row(3, "void a(int)", "9", metric="sm__cycles_elapsed.avg"),
        "==PROF== Disconnected from process 7",
    ]
    log.write_text("\n".join(lines) + "\n")
    kernels = kernel_trace.read_log(log)
    assert [k["name"] for k in kernels] == ["a", "b", "b", "a"]
    assert [k["us"] for k in kernels] == [1.0, 2.0, 1.5, 3.0]
    assert kernels[0]["grid"] == "(1, 1, 1)"
    summary = kernel_trace.summarise(kernels, steps=2)
    assert summary["kernels_per_step"] == 2
    assert summary["kernel_ms_per_step"] == pytest.approx(7.5e-3 / 2)
    a, b = summary["by_name"]
    assert (a["name"], a["calls_per_step"], a["median_us"]) == ("a", 1, 2.0)
    assert b["ms_per_step"] == pytest.approx(3.5e-3 / 2)
    assert [k["name"] for k in summary["last_step"]] == ["b", "a"]


def test_a_log_without_rows_reads_as_no_kernels(tmp_path):
    log = tmp_path / "ncu.csv"
    log.write_text("==PROF== Connected to process 7\n==ERROR== no kernels were profiled\n")
    assert kernel_trace.read_log(log) == []


def test_a_traced_process_that_fails_or_profiles_nothing_is_named(tmp_path, monkeypatch):
    import subprocess

    def child(returncode, writes_result):
        def run(command, **kwargs):
            Path(command[command.index("--log-file") + 1]).write_text("==PROF== no kernels\n")
            if writes_result:
                Path(command[-1]).write_text("{}")
            return subprocess.CompletedProcess(command, returncode)

        return run

    program = lambda result: ["python3", "child.py", str(result)]  # noqa: E731
    monkeypatch.setattr(kernel_trace.subprocess, "run", child(3, False))
    with pytest.raises(RuntimeError, match=r"the traced child at 8 rows failed \(3\)"):
        kernel_trace.run_traced("ncu", program, "child at 8 rows")
    monkeypatch.setattr(kernel_trace.subprocess, "run", child(0, True))
    with pytest.raises(
        RuntimeError, match=r"(?s)no kernel of the child at 8 rows.*==PROF== no kernels"
    ):
        kernel_trace.run_traced("ncu", program, "child at 8 rows")
