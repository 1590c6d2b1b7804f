"""What ``megatrain-jax plan`` tells a newcomer: every precision mode of the table re-planned, with its host
bytes per parameter, whether it fits and the host RAM it needs; the leanest mode's machine; and the longest
sequence that fits, also for small models."""

from __future__ import annotations

from pathlib import Path

from megatrain_jax.cli.commands import main
from megatrain_jax.engine import precision
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.models import preset
from megatrain_jax.plan import GiB, in_each_mode, longest_seq_len, machine_needed, modes_table, plan

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"
# h200_7b_32k.toml's engine, as the README's 70B run started from it
H200 = EngineConfig(micro_batches=1, prefetch_depth=1, clip_norm=1.0, resident_layers=20, resident_io=True)


def test_plan_prints_every_precision_mode_with_bytes_per_param_and_whether_it_fits(capsys):
    """Llama-3-70B on one H200 with 500 GiB of host: full precision needs over 1,100 GiB, and the plan says
    that capacity mode with 8-bit moments (~6.7 B/param, README) fits, each mode on its own line."""
    status = main(["plan", "-c", str(CONFIGS / "h200_7b_32k.toml"), "model.preset=llama3-70b",
                   "--host-gib", "500", "--gpu-gib", "141"])
    out = capsys.readouterr().out
    assert status == 1  # as configured (full precision), it does not fit
    lines = {mode.name: next(line for line in out.splitlines() if line.strip().startswith(mode.title + " ")
                             and "B/param" in line) for mode in precision.MODES.values()}
    assert "does not fit" in lines["full"]
    assert "(this run)" in lines["full"]
    assert lines["q8"].rstrip().endswith("fits")
    q8 = float(lines["q8"].split("B/param")[0].split()[-1])
    assert 6.0 < q8 < 7.5
    m7v5 = float(lines["m7v5"].split("B/param")[0].split()[-1])
    assert q8 - 0.6 < m7v5 < q8 - 0.3  # 12 bits of moments an element against 16: 0.44 B/param less
    assert lines["m7v5"].rstrip().endswith("fits")  # within the quality table's bar: no mark
    assert "in capacity mode with 7-bit m and 5-bit v, the leanest precision mode" in out


def test_a_run_that_fits_nowhere_gets_each_modes_host_ram():
    """At 300 GiB of host no mode fits the 70B: each mode's line says how much host RAM it needs (less for
    the leaner modes), and the machine needed names the leanest."""
    p = plan(preset("llama3-70b"), H200, 16, 2048, host_ram_bytes=300 * GiB, gpu_bytes=int(141 * GiB * 0.95))
    modes = in_each_mode(p)
    assert [m.mode for m in modes] == list(precision.MODES.values())
    assert not any(m.plan.fits for m in modes)
    need = {m.mode.name: m.host_gib for m in modes}
    assert need["m7v5"] < need["q8"] < need["capacity"] < need["full"] and 400 < need["q8"] < 480
    assert all(m.plan.replace(host_ram_bytes=m.host_gib * GiB).host_fits for m in modes)
    assert not modes[-1].plan.replace(host_ram_bytes=(need["m7v5"] - 1) * GiB).host_fits
    table = modes_table(p, modes)
    assert all(f"{n:,d} GiB host" in table for n in need.values())
    assert table.count("does not fit") == len(precision.MODES)
    assert (f"capacity mode with 7-bit m and 5-bit v, the leanest precision mode, {need['m7v5']:,d} GiB"
            in machine_needed(p))


def test_longest_sequence_of_a_small_model_that_fits(capsys):
    """A model whose max_positions is under 1,024 (the tiny preset: 512) fits: the longest sequence is its
    max_positions, not "none"; a run that fits at a length that is no multiple of 1,024 gets at least it."""
    tiny = plan(preset("tiny"), EngineConfig(), 16, 128, host_ram_bytes=60 * GiB, gpu_bytes=76 * GiB)
    assert tiny.fits and longest_seq_len(tiny) == 512
    odd = plan(preset("tiny", max_positions=1500), EngineConfig(), 16, 1500, host_ram_bytes=60 * GiB,
               gpu_bytes=76 * GiB)
    assert odd.fits and longest_seq_len(odd) == 1500
    assert main(["plan", "-c", str(CONFIGS / "demo_tiny.toml"), "--host-gib", "60", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "longest sequence that fits with 16 rows per batch as configured: 512 tokens" in out
    table = [line for line in out.splitlines() if "B/param" in line and "GiB host" in line]  # a line per mode
    assert len(table) == len(precision.MODES) and all(" fits" in line for line in table), table


def test_a_shortfall_under_a_tenth_of_a_gib_reads_in_mib():
    from megatrain_jax.plan.modes import shortfall
    GiB = 2**30
    assert shortfall(28.5 * GiB) == "28.5 GiB" and shortfall(0.06 * GiB) == "0.1 GiB"
    assert shortfall(0.03 * GiB) == "31 MiB" and shortfall(10) == "1 MiB"


def test_a_mode_over_the_quality_bar_or_not_yet_measured_is_marked_where_it_fits():
    """Every mode on the table today passes the quality bar, so none is marked; a new mode starts unmeasured
    (``quality_met=None``), and one measured over the bar (``False``) would be marked as training worse."""
    import dataclasses
    from megatrain_jax.plan.modes import InMode
    p = plan(preset("llama3-70b"), H200, 16, 2048, host_ram_bytes=2000 * GiB, gpu_bytes=int(141 * GiB * 0.95))
    fits = [m for m in in_each_mode(p) if m.plan is not None and m.plan.fits]
    assert fits and all(m.status() == "fits" for m in fits)
    m = fits[-1]
    for met, words in ((None, "fits (quality not yet measured"), (False, "fits (trains worse: over the quality bar")):
        assert InMode(dataclasses.replace(m.mode, quality_met=met), m.plan, m.host_gib).status().startswith(words)
