"""What ``plan`` (and ``train``, which asks the same plan) must refuse or say about the model's shape as written, the
environment's memory settings and ``plan``'s own flags: a message naming the value and what to write, never a
traceback, and never a plan made with a figure nobody meant."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatrain_jax import _environment
from megatrain_jax.cli import ConfigError, main, parse_config
from megatrain_jax.models import DecoderConfig, preset
from megatrain_jax.plan import machine


# ---------------------------------------------------------------------------------------------- the model's shape
@pytest.mark.parametrize("head_dim", [0, -4])
def test_a_head_dim_that_is_not_positive_is_refused_naming_it(head_dim):
    """``model.head_dim=-4`` planned a model of 0.00 B parameters (and a head of 0 was refused as a RoPE factor)."""
    with pytest.raises(ConfigError, match=rf"model\.head_dim={head_dim}.*head_dim must be a positive integer"):
        parse_config({}, "config", [f"model.head_dim={head_dim}"])
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        DecoderConfig(hidden=64, heads=4, kv_heads=4, head_dim=head_dim)


@pytest.mark.parametrize("name, meant", [("7B", "7b"), ("TINY", "tiny"), ("Llama3-8B", "llama3-8b")])
def test_a_preset_in_another_case_is_offered(name, meant):
    with pytest.raises(ValueError, match=rf"Did you mean \[{meant!r}"):
        preset(name)


def test_a_hugging_face_name_given_as_a_preset_points_at_hf_checkpoint():
    with pytest.raises(ConfigError, match=r"model\.hf_checkpoint"):
        parse_config({}, "config", ["model.preset=meta-llama/Meta-Llama-3-8B"])


# ---------------------------------------------------------------------------------------------- the environment
def _no_fraction_set(monkeypatch) -> None:
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["2", "abc", "0", "-0.5", "nan", "inf"])
def test_a_gpu_memory_fraction_outside_0_to_1_is_refused_naming_the_variable(value, monkeypatch, capsys):
    """``XLA_PYTHON_CLIENT_MEM_FRACTION=2`` planned for twice the card; ``=abc`` said "could not convert string to
    float"."""
    _no_fraction_set(monkeypatch)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
    assert main(["plan", "--gpu-gib", "80"]) == 2
    err = capsys.readouterr().err
    assert f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}" in err and "above 0 and at most 1" in err, err
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert machine.gpu_fraction() == 0.5


def _fresh_process(env: dict[str, str], code: str) -> str:
    """What ``code`` prints in a new Python that imports megatrain_jax first (as the command line does) with the
    memory variables of ``env`` and no others."""
    names = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
             "XLA_PYTHON_CLIENT_ALLOCATOR", "MEGATRAIN_GPU_FRACTION_SET")
    base = {k: v for k, v in os.environ.items() if k not in names}
    out = subprocess.run([sys.executable, "-c", "import megatrain_jax\n" + code], env=base | env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


# What JAX's GPU client takes from the environment when it starts (jaxlib.xla_client), and what the plan takes.
_FRACTIONS = ("from jaxlib import xla_client\n"
              "from megatrain_jax.plan import gpu_fraction\n"
              "from megatrain_jax._environment import gpu_fraction_source\n"
              "options = xla_client.generate_pjrt_gpu_plugin_options()\n"
              "print(options.get('memory_fraction', 0.75), gpu_fraction(), gpu_fraction_source())")


def test_jaxs_own_name_for_the_fraction_is_the_users_choice():
    """``XLA_CLIENT_MEM_FRACTION`` (JAX's name now; XLA_PYTHON_CLIENT_MEM_FRACTION is its deprecated one): importing
    megatrain_jax set the old name beside it, and JAX refused to start its GPU client with both set."""
    assert _fresh_process({"XLA_CLIENT_MEM_FRACTION": "0.5"}, _FRACTIONS) == "0.5 0.5 the user"
    inherited = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "MEGATRAIN_GPU_FRACTION_SET": "0.95"}  # a child's, ours
    assert _fresh_process({"XLA_CLIENT_MEM_FRACTION": "0.5", **inherited}, _FRACTIONS) == "0.5 0.5 the user"


def test_both_names_of_the_fraction_are_refused_as_jax_refuses_them(monkeypatch, capsys):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert main(["plan", "--gpu-gib", "80"]) == 2
    assert "unset XLA_PYTHON_CLIENT_MEM_FRACTION" in capsys.readouterr().err


@pytest.mark.parametrize("env", [{"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                                 {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}])
def test_a_user_allocator_choice_plans_with_jaxs_default_share(env):
    """Where the user chose how JAX allocates (and no fraction), megatrain_jax leaves JAX its 75%: the plan said 95%."""
    assert _fresh_process(env, _FRACTIONS) == "0.75 0.75 JAX's default"


@pytest.mark.parametrize("value, hint", [("1e9", ""), ("536870912000", "536870912000 bytes is 500 GiB")])
def test_a_host_ram_past_any_machine_is_refused(value, hint, monkeypatch, capsys):
    """``MEGATRAIN_HOST_RAM_GIB=1e9`` planned as a billion GiB; bytes written for GiB likewise."""
    monkeypatch.setenv("MEGATRAIN_HOST_RAM_GIB", value)
    with pytest.raises(ValueError, match=rf"MEGATRAIN_HOST_RAM_GIB='{value}'.*at most {_environment.MOST_HOST_GIB:,}"):
        machine.available_host_bytes()
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert "MEGATRAIN_HOST_RAM_GIB" in err and hint in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["no", "FALSE", "off"])
def test_a_preallocation_switch_jax_reads_as_on_is_said(value, monkeypatch, capsys):
    """JAX turns preallocation off only for false, False and 0: ``XLA_PYTHON_CLIENT_PREALLOCATE=no`` preallocates."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", value)
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert f"note: XLA_PYTHON_CLIENT_PREALLOCATE={value!r}: JAX turns preallocation off only for false" in out, out


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "-5"])
def test_a_pinned_pool_cap_xla_cannot_take_is_refused(value, monkeypatch, capsys):
    """XLA reads XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB as whole GiB: ``abc`` was planned as no cap of the user's (XLA takes
    64 GB), ``1.5`` as 1.5 GiB, and ``-5`` left ``plan`` running forever."""
    monkeypatch.setattr(_environment, "_USER_LIMIT", value)  # as the user set it before megatrain_jax started
    with pytest.raises(ValueError, match=rf"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={value!r}: .*whole number of GiB"):
        _environment.user_host_pool_limit()
    assert main(["plan", "model.preset=7b", "--host-gib", "200", "--gpu-gib", "80"]) == 2
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in capsys.readouterr().err
    monkeypatch.setattr(_environment, "_USER_LIMIT", " 200 ")
    assert _environment.user_host_pool_limit() == 200 * 2**30


def _fake_nvidia_smi(tmp_path, monkeypatch) -> None:
    """An ``nvidia-smi`` on PATH that answers as an H100's driver does (nvidia-smi lists every GPU, whatever
    CUDA_VISIBLE_DEVICES says)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$*" in *memory.total*) echo 81559;; *) echo "NVIDIA H100 80GB HBM3";; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("hidden", ["", "-1", " "])
def test_cuda_visible_devices_that_hides_every_gpu_plans_no_gpu_and_says_so(hidden, tmp_path, monkeypatch, capsys):
    """CUDA_VISIBLE_DEVICES empty (or -1) hides every GPU from CUDA, so the run is on the CPU: the plan read the
    driver's GPU and planned a GPU side for it."""
    _fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert machine.gpu_bytes_before_jax() == int(81559 * 2**20 * 0.95)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert machine.gpu_bytes_before_jax() is None and machine.gpu_name_before_jax() is None
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" in out, out


def test_cuda_visible_devices_counts_up_to_the_first_entry_naming_no_gpu(monkeypatch):
    """CUDA sees the devices listed before the first invalid entry: ``0,-1,1`` is one GPU, not two."""
    for listed, count in (("0,-1,1", 1), ("0,1", 2), ("GPU-5d2c1e3a,MIG-1", 2), ("1,x,2", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert _environment.visible_gpus() == count, listed


# ---------------------------------------------------------------------------------------------- plan's flags
@pytest.mark.parametrize("name, meant", [("H2000", "H200"), ("rtx4090", "RTX 4090"), ("4090", "RTX 4090"),
                                         ("h-100", "H100")])
def test_a_misspelt_gpu_name_is_refused_with_the_close_match(name, meant, capsys):
    """``--gpu H2000`` planned as an H200 (its name holds "H200"); ``--gpu rtx4090`` was refused with no hint."""
    assert main(["plan", "--gpu", name]) == 2
    err = capsys.readouterr().err
    assert f"--gpu {name!r}: no rates for that GPU; did you mean {meant!r}?" in err, err


@pytest.mark.parametrize("name", ["h200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "RTX 6000 Ada"])
def test_a_gpu_named_as_its_driver_names_it_is_taken(name, capsys):
    assert main(["plan", "--gpu", name, "--host-gib", "64"]) == 0
    assert "predicted step: " in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, hint", [("--gpu-gib", "81559", "81559 MiB is 79.6 GiB"),
                                               ("--host-gib", "1e9", "")])
def test_a_size_past_any_machine_is_refused(flag, value, hint, capsys):
    """``--gpu-gib 81559`` (nvidia-smi's MiB) planned for an 80 TiB GPU."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: {value!r} is more than" in err and hint in err, err


def test_plan_names_the_fraction_variable_in_force(monkeypatch, capsys):
    """With JAX's newer ``XLA_CLIENT_MEM_FRACTION``, plan named XLA_PYTHON_CLIENT_MEM_FRACTION all the same."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    assert main(["plan", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "XLA may allocate 90% of it" in out and "(XLA_CLIENT_MEM_FRACTION, set by" in out, out
