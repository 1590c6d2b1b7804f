"""The torch side of the live Hugging Face checks: transformers' own logits and RoPE, which tests/test_hf.py and
tests/test_gpt_oss.py compare ours against (the fixtures' numbers, and what our export loads as in transformers).

jax 0.11.2 needs Python >= 3.12, and the development and CI machines hold torch's CPU build for Python 3.11 only.
So where torch cannot be imported beside jax, this file runs in a second interpreter, the one named by
MEGATRAIN_TORCH_PYTHON (a Python 3.11 venv with torch and transformers; .ci/run makes it), as a server that
answers one JSON request per line. The server side imports neither jax nor the package.

    python tests/torch_side.py serve                              # requests on stdin, replies on stdout
    python tests/torch_side.py logits FOLDER TOKENS.npy OUT.npy   # one forward, to look at by hand

``connect`` (the tests' side, used by the ``hf_torch`` fixture in tests/conftest.py) picks this interpreter where
torch and transformers import, else the server in MEGATRAIN_TORCH_PYTHON.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

TORCH_PYTHON = "MEGATRAIN_TORCH_PYTHON"
# The releases that wrote tests/fixtures/hf (scripts/make_hf_fixtures.py): what the torch venv installs
VERSIONS = Path(__file__).parent / "fixtures" / "hf" / "VERSIONS.json"


# --- the torch side -----------------------------------------------------------------------------------------------

def logits(folder: str | Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' fp32 logits [B, T, V] of an HF folder (eager attention: the reference, not a kernel)."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()


def longrope(config: dict, seq_len: int | None) -> tuple[np.ndarray, float]:
    """Phi-3's LongRoPE as transformers computes it: inv_freq and the factor cos and sin are scaled by."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = transformers.Phi3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    inv, attention = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=seq_len)
    return inv.numpy(), float(attention)


def _logits_op(request: dict) -> dict:
    np.save(request["out"], logits(request["folder"], np.load(request["tokens"])))
    return {}


def _longrope_op(request: dict) -> dict:
    inv, attention = longrope(request["config"], request["seq_len"])
    return {"inv_freq": inv.tolist(), "attention": attention}  # float32 -> float is exact, and so is JSON's repr


OPS = {"logits": _logits_op, "longrope": _longrope_op}


def serve() -> None:
    """Answer requests (one JSON object a line, ``op`` naming an entry of OPS) until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever torch or transformers print goes to stderr, never into a reply
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = OPS[request["op"]](request)
        except Exception:  # the test that asked shows it
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# --- the tests' side ----------------------------------------------------------------------------------------------

class HFTorch:
    """transformers with torch, reached through ``ask`` (a request dict -> its reply dict)."""

    def __init__(self, ask, workdir: Path, close=lambda: None):
        self._ask, self._workdir, self.close, self._n = ask, workdir, close, itertools.count()

    def logits(self, folder: Path, tokens: np.ndarray) -> np.ndarray:
        n = next(self._n)
        tokens_path, out = self._workdir / f"tokens_{n}.npy", self._workdir / f"logits_{n}.npy"
        np.save(tokens_path, tokens)
        self._ask({"op": "logits", "folder": str(Path(folder).resolve()), "tokens": str(tokens_path),
                   "out": str(out)})
        return np.load(out)

    def longrope(self, config: dict, seq_len: int | None) -> tuple[np.ndarray, float]:
        reply = self._ask({"op": "longrope", "config": config, "seq_len": seq_len})
        return np.asarray(reply["inv_freq"], np.float32), reply["attention"]


class _Server:
    """This file serving in ``python``: one process for a test session (each pytest-xdist worker has its own)."""

    def __init__(self, python: str, workdir: Path):
        self.python, self.log = python, workdir / "torch_side.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([python, __file__, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True,
                                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})

    def ask(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"tests/torch_side.py serve in {TORCH_PYTHON}={self.python} ended (exit code "
                               f"{self.proc.wait()}); its stderr ends:\n{self.log.read_text()[-3000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"transformers in {TORCH_PYTHON}={self.python} failed on {request['op']!r}:\n"
                               f"{reply['error']}")
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def connect(workdir: Path) -> tuple[HFTorch | None, str]:
    """transformers with torch in this interpreter where both import, else in MEGATRAIN_TORCH_PYTHON; (None, why)
    where neither. A MEGATRAIN_TORCH_PYTHON that does not start is an error, not a reason to skip."""
    if all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        return HFTorch(lambda request: OPS[request["op"]](request), workdir), "in this interpreter"
    python = os.environ.get(TORCH_PYTHON)
    if not python:
        pins = " ".join(f"{name}=={version}" for name, version in json.loads(VERSIONS.read_text()).items())
        return None, (f"torch and transformers are not importable here and {TORCH_PYTHON} is not set: make a Python "
                      f"3.11 venv with `pip install {pins}` and set {TORCH_PYTHON} to its bin/python "
                      f"(docs/contributing.md)")
    server = _Server(python, workdir)
    return HFTorch(server.ask, workdir, server.close), f"in {python}"


def main(argv: list[str]) -> None:
    if argv == ["serve"]:
        serve()
    elif len(argv) == 4 and argv[0] == "logits":
        np.save(argv[3], logits(argv[1], np.load(argv[2])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
