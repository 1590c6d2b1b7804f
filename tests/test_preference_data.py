"""Preference data for DPO (``megatrain_jax.data.preference``): the three line formats through a checkpoint's own
tokenizer and chat template, the loss on each response only, pairs as adjacent rows, an error naming the line
for each bad input, and a run from a JSONL file through the reference pass to training steps."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from megatrain_jax import DPO, Decoder, Engine, EngineConfig, preset  # noqa: E402
from megatrain_jax.data.instruct import ChatTokenizer, InstructDataError  # noqa: E402
from megatrain_jax.data.preference import PreferenceData, evaluate_pairs, pair_logps, read_pairs  # noqa: E402

from test_instruct import make_tokenizer_folder, write_jsonl  # noqa: E402

PLAIN = {"prompt": "what is two plus two? ", "chosen": "four.", "rejected": "the lazy dog."}
CHAT = {"prompt": [{"role": "user", "content": "what is two plus two?"}],
        "chosen": [{"role": "assistant", "content": "four."}],
        "rejected": [{"role": "assistant", "content": "the fox."}]}
IMPLICIT = {"chosen": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "and the fox?"},
                       {"role": "assistant", "content": "it jumps."}],
            "rejected": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "and the fox?"},
                         {"role": "assistant", "content": "hello world."}]}
MULTI_TURN = {"prompt": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"},
                         {"role": "user", "content": "what is two plus two?"}],
              "chosen": [{"role": "assistant", "content": "four."}],
              "rejected": [{"role": "assistant", "content": "cheese."}]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return ChatTokenizer.from_folder(make_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def learned(tok, ids, mask) -> str:
    return tok.tokenizer.decode([int(t) for t, m in zip(ids[1:], mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize("line,chosen,rejected", [
    (PLAIN, "four.</s>", "the lazy dog.</s>"),
    (CHAT, "four.<|im_end|>\n", "the fox.<|im_end|>\n"),
    (IMPLICIT, "it jumps.<|im_end|>\n", "hello world.<|im_end|>\n"),
    (MULTI_TURN, "four.<|im_end|>\n", "cheese.<|im_end|>\n"),
], ids=["plain", "chat", "implicit-prompt", "multi-turn-prompt"])
def test_only_each_response_carries_loss(chatml, tmp_path, line, chosen, rejected):
    """The prompt (a multi-turn prompt's assistant turn too) carries no loss; each response and its end marker
    do; both rows of a pair begin with the same prompt tokens."""
    pairs, stats = read_pairs(write_jsonl(tmp_path / "p.jsonl", [line]), chatml, seq_len=128)
    assert stats.kept == 1 and pairs[0].line == 1
    (ci, cm), (ri, rm) = pairs[0].chosen, pairs[0].rejected
    # (a token is learned if any of its characters is the response's: BPE may join the prompt's last space to it)
    assert learned(chatml, ci, cm).lstrip() == chosen and learned(chatml, ri, rm).lstrip() == rejected
    start = int(np.argmax(cm))  # the first learned target: the tokens before it are the prompt's
    np.testing.assert_array_equal(ci[:start], ri[:start])


def test_pairs_become_adjacent_padded_rows_with_their_reference_values(chatml, tmp_path):
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, CHAT, IMPLICIT]), chatml, seq_len=64)
    data = PreferenceData(pairs, seq_len=64, pad_id=3)
    ref = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = data.batch(np.array([2, 0]), ref)
    assert b.shape == (4, 64) and b.ref_logps.tolist() == [4.0, 5.0, 0.0, 1.0]
    ids, mask = pairs[2].rejected
    n = len(ids) - 1
    np.testing.assert_array_equal(b.inputs[1, :n], ids[:-1])
    np.testing.assert_array_equal(b.loss_mask[1, :n], mask)
    assert (b.inputs[1, n:] == 3).all() and (b.loss_mask[1, n:] == 0).all()
    ordered = list(data.ordered(4))  # 3 pairs in batches of 2: the last filled with the first pair again
    assert len(ordered) == 2 and np.array_equal(ordered[1].inputs[2:], ordered[0].inputs[:2])
    stream = data.batches(4, seed=0, ref_logps=ref)
    seen = [next(stream).ref_logps for _ in range(3)]  # one permutation of the 3 pairs, then the next
    assert sorted(np.concatenate(seen)[:6].tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="ref_logps must hold \\[pairs, 2\\] = \\[3, 2\\]"):
        next(data.batches(4, seed=0, ref_logps=np.zeros(6)))
    with pytest.raises(ValueError, match="batch_size must be even"):
        next(data.ordered(3))
    train, held = data.split(0.34)
    assert len(train) == 2 and len(held) == 1 and held.pairs[0] is pairs[2]


@pytest.mark.parametrize("line,match", [
    ('{"prompt": "a", "chosen": "b"', "p.jsonl:2: not valid JSON"),
    ({"prompt": "a", "chosen": "b"}, "p.jsonl:2: a preference line needs 'chosen' and 'rejected'"),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]},
     "must all be strings .* not a mix"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "y"}]}, "share no first message"),
    ({"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "user", "content": "y"}],
      "rejected": [{"role": "assistant", "content": "z"}]}, "chosen response must end with an assistant message"),
    ({"prompt": [{"role": "robot", "content": "x"}], "chosen": [{"role": "assistant", "content": "y"}],
      "rejected": [{"role": "assistant", "content": "z"}]}, "prompt\\[0\\] has the unknown role 'robot'"),
    ({"chosen": "four.", "rejected": "five."}, "plain-text 'chosen' and 'rejected' need a 'prompt' string"),
], ids=["json", "missing", "mixed", "no-common-prompt", "not-assistant", "role", "text-without-prompt"])
def test_a_bad_line_is_refused_naming_it(chatml, tmp_path, line, match):
    with pytest.raises(InstructDataError, match=match):
        read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, line]), chatml, seq_len=64)


def test_long_pairs_are_cut_or_skipped_and_counted(chatml, tmp_path):
    long = dict(PLAIN, rejected="the quick brown fox jumps over the lazy dog " * 8)
    path = write_jsonl(tmp_path / "p.jsonl", [PLAIN, long])
    pairs, stats = read_pairs(path, chatml, seq_len=24)
    assert stats.kept == 2 and stats.truncated == 1
    assert max(len(ids) for p in pairs for ids, _ in (p.chosen, p.rejected)) == 25
    pairs, stats = read_pairs(path, chatml, seq_len=24, too_long="skip")
    assert stats.kept == 1 and stats.skipped_too_long == 1
    with pytest.raises(InstructDataError, match="no usable pair .* 1 too long and skipped"):
        read_pairs(write_jsonl(tmp_path / "q.jsonl", [long]), chatml, seq_len=24, too_long="skip")


def test_pairs_whose_sides_are_the_same_are_skipped_and_counted(chatml, tmp_path):
    """A pair whose chosen and rejected sides are the same teaches nothing (its loss is log 2 whatever the weights):
    left out and counted, as written or once both are cut to seq_len + 1 tokens; a file of nothing else is refused."""
    same = dict(PLAIN, rejected=PLAIN["chosen"])
    tail = "the quick brown fox jumps over the lazy dog " * 8
    past = dict(PLAIN, chosen=tail + "one", rejected=tail + "two")  # they differ only past the cut
    pairs, stats = read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, same, past]), chatml, seq_len=24)
    assert [p.line for p in pairs] == [1] and stats.kept == 1 and stats.skipped_identical == 2
    with pytest.raises(InstructDataError, match="no usable pair .* 1 with both sides the same"):
        read_pairs(write_jsonl(tmp_path / "q.jsonl", [same]), chatml, seq_len=24)


def test_preference_pairs_are_tokenized_once_into_the_cache(chatml, tmp_path, monkeypatch, capsys):
    """``DataConfig.preference_pairs`` (what ``plan`` and then ``train`` read) tokenizes a file once into
    ``data.cache_dir``; a later read with the same file, tokenizer, seq_len and too_long gets the same pairs back
    without tokenizing; a change of any of them, or a damaged entry, tokenizes again. The tokenizer's vocabulary is
    checked against the model's either way."""
    import dataclasses
    import shutil

    from megatrain_jax.data import DataConfig
    from megatrain_jax.data import preference
    tokenizer = tmp_path / "tok"
    shutil.copytree(chatml.where, tokenizer)
    path = write_jsonl(tmp_path / "p.jsonl", [PLAIN, CHAT, IMPLICIT, MULTI_TURN])
    d = DataConfig(path=str(path), format="preference", mode="padded", batch_size=4, seq_len=48,
                   tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"))
    first, stats = d.preference_pairs(512)
    tokenized = []
    read = preference.read_pairs
    monkeypatch.setattr(preference, "read_pairs", lambda *a, **k: tokenized.append(a[0]) or read(*a, **k))
    again, stats_again = d.preference_pairs(512)
    assert tokenized == [] and stats_again == stats and len(again) == len(first) == 4
    for a, b in zip(first.pairs, again.pairs):
        assert a.line == b.line
        for (ids_a, mask_a), (ids_b, mask_b) in ((a.chosen, b.chosen), (a.rejected, b.rejected)):
            assert ids_b.dtype == ids_a.dtype and mask_b.dtype == mask_a.dtype
            np.testing.assert_array_equal(ids_b, ids_a)
            np.testing.assert_array_equal(mask_b, mask_a)
    with pytest.raises(ValueError, match="has .* tokens, more than the model's vocab_size = 100"):
        d.preference_pairs(100)  # from the cache too
    assert tokenized == []
    for changed in (dataclasses.replace(d, seq_len=24), dataclasses.replace(d, too_long="skip", seq_len=24)):
        changed.preference_pairs(512)
    assert len(tokenized) == 2
    write_jsonl(path, [PLAIN, CHAT, IMPLICIT])  # the file changed
    assert len(d.preference_pairs(512)[0]) == 3 and len(tokenized) == 3
    config = tokenizer / "tokenizer_config.json"  # the tokenizer (its template, say) changed
    config.write_text(config.read_text().replace("{", '{"model_max_length": 4096, ', 1))
    d.preference_pairs(512)
    assert len(tokenized) == 4
    d.preference_pairs(512)
    assert len(tokenized) == 4
    for entry in (tmp_path / "cache").iterdir():
        entry.write_bytes(b"not what was written")
    assert len(d.preference_pairs(512)[0]) == 3 and len(tokenized) == 5
    assert "is damaged" in capsys.readouterr().err
    blocked = tmp_path / "a_file"  # a cache folder that cannot be made: said, and the pairs read all the same
    blocked.write_text("")
    assert len(dataclasses.replace(d, cache_dir=str(blocked / "cache")).preference_pairs(512)[0]) == 3
    assert "set data.cache_dir to a writable folder" in capsys.readouterr().err


def test_a_preference_file_trains_through_the_reference_pass(chatml, tmp_path):
    """JSONL to tokens, the reference pass on the untrained model (one log-probability per side, the padded
    last batch's extra rows dropped), then DPO steps on the engine: the first at log 2, the loss falling."""
    lines = [PLAIN, CHAT, IMPLICIT, MULTI_TURN, dict(PLAIN, chosen="four!", rejected="cheese")]
    pairs, stats = read_pairs(write_jsonl(tmp_path / "p.jsonl", lines), chatml, seq_len=48)
    assert stats.kept == 5, stats
    vocab = chatml.tokenizer.get_vocab_size(with_added_tokens=True)
    engine = Engine(Decoder(preset("tiny", layers=2, vocab_size=vocab), rngs=nnx.Rngs(0)), optax.adamw(3e-3),
                    EngineConfig(), objective=DPO(beta=0.5))
    data = PreferenceData(pairs, seq_len=48)
    ref = pair_logps(engine, data, batch_rows=4)
    assert ref.shape == (5, 2) and np.all(ref < 0)
    one = pair_logps(engine, PreferenceData(pairs[4:], seq_len=48), batch_rows=4)
    np.testing.assert_allclose(one, ref[4:], rtol=1e-5)  # the same pair alone, in a batch of its own
    stream = data.batches(4, seed=0, ref_logps=ref)
    losses = [engine.step(next(stream)).resolve()["loss"] for _ in range(15)]
    assert losses[0] == pytest.approx(np.log(2.0), rel=1e-5) and np.mean(losses[-3:]) < 0.6 * np.log(2.0)


def test_train_runs_dpo_from_a_preference_file_and_resumes(tmp_path, capsys):
    """``megatrain-jax train`` with ``[data] format = "preference"`` on the tiny HF folder of
    scripts/make_tiny_hf.py: the reference pass on the loaded weights (written beside the run), DPO steps with
    their rewards in metrics.jsonl, the held-out pair evaluated with the objective, the export; a resumed run reads
    the same reference values back and ends where one run would."""
    import importlib.util
    import json
    from pathlib import Path

    from megatrain_jax.cli import main
    script_path = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_hf.py"
    spec = importlib.util.spec_from_file_location("make_tiny_hf", script_path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path / "tiny"), "--examples", "4", "--steps", "4"]) == 0
    chats = [json.loads(x)["messages"] for x in (tmp_path / "tiny" / "chat.jsonl").read_text().splitlines()]
    lines = [{"prompt": m[:-1], "chosen": [m[-1]], "rejected": [{"role": "assistant", "content": "I do not know."}]}
             for m in chats]
    prefs = write_jsonl(tmp_path / "prefs.jsonl", lines)
    common = ["--config", str(tmp_path / "tiny" / "sft.toml"), "data.format=preference", f"data.path={prefs}",
              "data.mode=padded", "data.eval_fraction=0.25", "train.eval_every=2", "log.tensorboard=false",
              "dpo.beta=0.5", "optimizer.warmup_steps=0", "optimizer.decay=constant",
              f"data.cache_dir={tmp_path / 'cache'}"]

    def run(name, steps, *extra):
        status = main(["train", *common, f"train.run_dir={tmp_path / name}", f"train.steps={steps}",
                       f"train.export_hf={tmp_path / f'{name}_{steps}_hf'}", *extra])
        assert status == 0, capsys.readouterr().err
        records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if "loss" in r], np.load(tmp_path / name / "dpo_reference.npy")

    whole, ref = run("whole", 4)
    assert (tmp_path / "whole_4_hf" / "model.safetensors").exists()
    assert ref.shape == (4, 2) and np.all(ref < 0)  # 3 training pairs, then the held-out one
    held = [r for r in whole if "eval_loss" in r]  # DPO itself on the held-out pair, after steps 2 and 4
    assert [r["step"] for r in held] == [2, 4] and all(0.0 <= r["eval_rewards_accuracy"] <= 1.0 for r in held)
    assert whole[0]["loss"] == pytest.approx(np.log(2.0), rel=1e-5) and whole[0]["rewards_accuracy"] == 0.0
    assert all("rewards_margin" in r for r in whole) and whole[-1]["rewards_margin"] > 0
    ckpt = f"train.checkpoint_dir={tmp_path / 'ckpt'}"
    run("first", 2, ckpt, "train.checkpoint_every=2")
    resumed, ref2 = run("first", 4, ckpt, "train.checkpoint_every=2", "train.resume=true")
    said = capsys.readouterr()
    assert "reference log-probabilities of 4 pairs read from" in said.out + said.err  # not taken again
    np.testing.assert_array_equal(ref2, ref)
    assert [r["loss"] for r in resumed[-2:]] == pytest.approx([r["loss"] for r in whole[-2:]], rel=1e-6)
    # the data edited since (as many pairs, one answer changed): the reference values are of other pairs, refused
    lines[0] = dict(lines[0], rejected=[{"role": "assistant", "content": "No idea at all, sorry."}])
    write_jsonl(prefs, lines)
    assert main(["train", *common, f"train.run_dir={tmp_path / 'first'}", "train.steps=6", ckpt,
                 "train.checkpoint_every=2", "train.resume=true"]) != 0
    said = capsys.readouterr()
    assert "of other pairs" in said.err and "loading weights" not in said.out  # refused before the weights load
    np.testing.assert_array_equal(np.load(tmp_path / "first" / "dpo_reference.npy"), ref)  # nothing lost


def test_dpo_settings_without_preference_data_and_an_endless_stream_without_steps_are_refused(chatml, tmp_path):
    from megatrain_jax import TrainConfig, fit
    from megatrain_jax.cli import ConfigError, parse_config
    with pytest.raises(ConfigError, match=r"\[dpo\] sets preference training, which reads \[data\] format"):
        parse_config({"dpo": {"beta": 0.5}})
    parse_config({})  # the defaults of [dpo] with another format: nothing to refuse
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, CHAT]), chatml, seq_len=32)
    data = PreferenceData(pairs, seq_len=32)
    model = Decoder(preset("tiny", layers=1, vocab_size=512), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="PairStream never ends"):
        fit(model, lambda engine: data.batches(4, 0, pair_logps(engine, data, 4)), optax.adamw(1e-3),
            train=TrainConfig(steps=None, log_every=0), objective=DPO())


def test_held_out_pairs_are_evaluated_with_the_objective(chatml, tmp_path):
    """``evaluate_pairs``: DPO's loss and rewards of held-out pairs from a forward-only pass; with the weights the
    reference values came from, the loss is log 2 and no pair is preferred."""
    pairs, _ = read_pairs(write_jsonl(tmp_path / "p.jsonl", [PLAIN, CHAT, IMPLICIT]), chatml, seq_len=48)
    vocab = chatml.tokenizer.get_vocab_size(with_added_tokens=True)
    engine = Engine(Decoder(preset("tiny", layers=1, vocab_size=vocab), rngs=nnx.Rngs(0)), optax.adamw(1e-3),
                    EngineConfig(), objective=DPO(beta=0.5))
    train, held = PreferenceData(pairs, seq_len=48).split(0.34)
    ref = pair_logps(engine, held, 4)
    got = evaluate_pairs(engine, held, ref, 4)
    assert got["eval_pairs"] == 1 and got["eval_loss"] == pytest.approx(np.log(2.0), rel=1e-6)
    assert got["eval_rewards_accuracy"] == 0.0 and got["eval_rewards_margin"] == 0.0
    shifted = evaluate_pairs(engine, held, ref + np.array([[-1.0, 1.0]]), 4)  # the reference preferred rejected
    assert shifted["eval_rewards_accuracy"] == 1.0 and shifted["eval_loss"] < np.log(2.0)
    with pytest.raises(ValueError, match="ref_logps must hold \\[pairs, 2\\] = \\[1, 2\\]"):
        evaluate_pairs(engine, held, np.zeros(2), 4)
