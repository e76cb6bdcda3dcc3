"""Every docs/benchmarks/NAME.md is what its NAME.json and NAME.notes.md render to."""
from __future__ import annotations

import glob
import os

import pytest

from benchmarks import pages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = sorted(glob.glob(os.path.join(ROOT, "docs", "benchmarks", "*.json")))


def test_every_record_file_has_a_renderer():
    assert RECORDS, "no docs/benchmarks/*.json"
    for path in RECORDS:
        assert pages.kind(path) in pages.RENDERERS


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_committed_markdown_is_the_fresh_render(path, tmp_path):
    name = os.path.splitext(os.path.basename(path))[0]
    pages.write(path, str(tmp_path), png=False)
    fresh = (tmp_path / f"{name}.md").read_text()
    committed_path = os.path.splitext(path)[0] + ".md"
    assert os.path.exists(committed_path), f"docs/benchmarks/{name}.md is missing"
    with open(committed_path) as f:
        committed = f.read()
    assert committed == fresh, (
        f"docs/benchmarks/{name}.md differs from the render of {name}.json and {name}.notes.md;"
        f" regenerate it: python -m benchmarks.pages docs/benchmarks/{name}.json")


def test_memory_page_marks_failed_runs_and_ops():
    """A run out of memory, a run that failed otherwise and an op that failed say so."""
    from benchmarks.bench import memory
    model = dict(kind="train", layers="gdn,attn", hidden=64, heads=2, head_dim=32,
                 device="GPU", jax="0")
    records = [dict(model, T_local=1024, remat="none", fits=True, peak_gib=1.5, step_ms=250.0),
               dict(model, T_local=2048, remat="none", fits=False,
                    error="RESOURCE_EXHAUSTED: Out of memory while trying to allocate"),
               dict(model, T_local=2048, remat="block", fits=False, error="no result within 9 s"),
               dict(kind="op", op="kda", impl="fla", T=8, H=2, K=16, V=16, error="no torch"),
               dict(kind="op", op="gdn", impl="jaxcp", T=8, H=2, K=16, V=16, peak_bytes=16000,
                    device="GPU")]
    text = memory.markdown(records)
    assert "| 1,024 | 1.5 GiB, 0.25 s | - |" in text
    assert "| 2,048 | out of memory | failed: no result within 9 s |" in text
    assert "failed: no torch" in text and "| GDN | jaxcp | 8 | 2 | 16 | 0.00 | 1.00 |" in text


def test_kernel_page_shows_peak_memory_when_recorded():
    from benchmarks.bench import kernels
    row = dict(op="kda", T=8, H=2, K=16, V=16, device="H100", **{"pass": "fwd"})
    records = [dict(row, impl="jaxcp-pallas", ms=2.0, peak_bytes=2 ** 30),
               dict(row, impl="fla", ms=1.0, peak_bytes=2 ** 31)]
    text = kernels.markdown(records)
    assert "| 8 | 2 | 16 | fwd | 2.00 | 1.00 | 2.00x |" in text and "| 1.00 / 2.00 |" in text
    assert "peak GiB" not in kernels.markdown([{k: v for k, v in r.items() if k != "peak_bytes"}
                                              for r in records])


def test_kernel_page_says_when_the_gate_is_computed_in_the_op_or_sequences_are_packed():
    from benchmarks.bench import kernels
    row = dict(op="kda", T=8, H=2, K=16, V=16, device="H100", ms=1.0, **{"pass": "fwd"})
    records = [dict(row, impl="jaxcp-pallas"), dict(row, impl="fla")]
    assert "use_gate_in_kernel" not in kernels.markdown(records)
    assert "packed" not in kernels.markdown(records)
    gated = [dict(r, gate_in_kernel=True) for r in records]
    assert "gate computed in the op" in kernels.markdown(gated)
    packed = [dict(r, **kernels.Setting(packed=True).fields(8)) for r in records]
    assert "ten packed sequences" in kernels.markdown(packed)


def test_kernel_bench_setting_is_what_its_records_and_flags_say():
    from benchmarks.bench import cp, kernels
    assert kernels.Setting().fields(32768) == {} and kernels.Setting().flags() == []
    assert kernels.Setting().cu_seqlens(32768) is None
    packed = kernels.Setting(gate_in_kernel=True, packed=True)
    assert packed.cu_seqlens(32768) == cp.VARLEN
    assert packed.fields(32768) == {"gate_in_kernel": True, "cu_seqlens": cp.VARLEN}
    assert packed.flags() == ["--gate-in-kernel", "--packed"]


def test_kernel_page_sets_jaxcp_against_flashqla_where_it_ran():
    """FlashQLA's columns (with and without its split) and a pallas / FlashQLA ratio beside
    FLA's; a shape FlashQLA did not take shows "-"."""
    from benchmarks.bench import kernels
    row = dict(op="gdn", K=128, V=128, H=2, device="NVIDIA H200", **{"pass": "fwd"})
    records = [dict(row, impl="jaxcp-pallas", T=8, ms=3.0), dict(row, impl="fla", T=8, ms=4.0),
               dict(row, impl="flashqla", T=8, ms=2.0, flashqla="0.1.3"),
               dict(row, impl="flashqla-nocp", T=8, ms=2.5, flashqla="0.1.3"),
               dict(row, impl="jaxcp-pallas", T=16, ms=3.0), dict(row, impl="fla", T=16, ms=4.0)]
    text = kernels.markdown(records)
    assert "| jaxcp-pallas | fla | flashqla | flashqla-nocp | pallas / FLA | pallas / FlashQLA |" \
        in text
    assert "| 8 | 2 | 128 | fwd | 3.00 | 4.00 | 2.00 | 2.50 | 0.75x | 1.50x |" in text
    assert "| 16 | 2 | 128 | fwd | 3.00 | 4.00 | - | - | 0.75x | - |" in text
    assert "FlashQLA 0.1.3" in text


def test_cp_page_has_a_section_per_op_and_a_target_row_per_layout():
    """GDN and KDA each get their tables; allgather's zigzag row is set against the one
    all_to_all run; a record without a layout (older files) is contiguous."""
    from benchmarks.bench import cp
    row = dict(T=8, H=2, K=16, V=16, nseq=1, device="H100", **{"pass": "fwd"})
    jax_row = dict(row, impl="jaxcp-pallas")
    records = [dict(jax_row, op="gdn", strategy="none", W=1, ms=4.0),
               dict(jax_row, op="gdn", strategy="allgather", W=2, ms=2.5),
               dict(jax_row, op="kda", strategy="none", W=1, ms=4.0, layout="contiguous"),
               dict(jax_row, op="kda", strategy="allgather", W=2, ms=2.5, layout="contiguous"),
               dict(jax_row, op="kda", strategy="allgather", W=2, ms=2.0, layout="zigzag"),
               dict(jax_row, op="kda", strategy="all_to_all", W=2, ms=5.0, layout="contiguous"),
               dict(row, impl="fla", op="kda", strategy="fla-kcp", W=2, ms=4.0,
                    layout="contiguous")]
    text = cp.markdown(records)
    gdn, kda = text.split("## GDN")[1].split("## KDA")
    assert "| 1 | fwd | contiguous | 2.50 | - | - | - | 0.80 |" in gdn
    assert "| 1 | fwd | contiguous | 2.50 | 4.00 | 0.62x | 2.00x | 0.80 |" in kda
    assert "| 1 | fwd | zigzag | 2.00 | - | - | 2.50x | 1.00 |" in kda
    assert "| jaxcp-pallas | allgather | zigzag | 1 | fwd | 2.00 | 100% | 0.00 |" in kda


@pytest.mark.parametrize("tool, flags", [
    *(("memory", f) for f in (["--steps", "1"], ["--ops", "gla"], ["--impls", "jax"],
                              ["--T", "0"])),
    *(("cp", f) for f in (["--ops", "gla"], ["--cp-layouts", "striped"],
                          ["--strategies", "ring"], ["--T", "0"])),
    *(("segments", f) for f in (["--ops", "gla"], ["--configs", "8:2"], ["--devices", "0"],
                                ["--segments", "0"])),
    *(("kernels", f) for f in (["--impls", "jaxcp-cuda"], ["--impls", "flashqla", "--op", "kda"],
                               ["--impls", "jaxcp-mosaic", "--op", "kda"],
                               ["--compile-threads", "0"]))])
def test_bench_flag_errors(tool, flags, capsys):
    """Bad flags of a benchmark tool: exit code 2 and one line naming the flag, before any
    run."""
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.bench.{tool}").main(flags)
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err.strip().splitlines()[-1]


def test_kernel_bench_child_hands_its_records_back_in_a_file(tmp_path, monkeypatch, capsys):
    """The PyTorch child's records reach the parent through the file it is given, whatever
    the libraries it runs print on stdout."""
    import json
    from benchmarks.bench import kernels
    record = dict(op="gdn", impl="fla", T=64, H=1, K=64, V=64, ms=1.0)

    def run_torch(impls, op, configs, iters, setting):
        print("a library's message on stdout")
        assert setting == kernels.Setting(packed=True)
        return [dict(record, impl=impl) for impl in impls]

    monkeypatch.setattr(kernels, "run_torch", run_torch)
    path = tmp_path / "records.json"
    assert kernels.main(["--torch-child", str(path), "--impls", "fla,flashqla",
                         "--configs", "64:1:64", "--packed"]) == 0
    assert json.loads(path.read_text()) == [record, dict(record, impl="flashqla")]
    assert "a library's message" in capsys.readouterr().out


def test_kernel_bench_times_packed_sequences_on_cpu(tmp_path):
    """--packed end to end on the CPU (the jnp backend): each record carries the packed
    sequences' offsets, and the page says so."""
    import json
    from benchmarks.bench import cp, kernels
    path = tmp_path / "packed.json"
    assert kernels.main(["--impls", "jaxcp-xla", "--packed", "--configs", "128:1:64",
                         "--iters", "1", "--compile-threads", "1", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["pass"] for r in records] == ["fwd", "fwd+bwd"]
    assert all(r["cu_seqlens"] == cp.layouts(128, ["packed"])[0] for r in records)
    assert "ten packed sequences" in kernels.markdown(records)
