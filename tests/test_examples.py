"""The examples run end to end at toy sizes and learn something."""
import json
import math

from fmoe.examples import charlm, helloworld


def test_helloworld_loss_decreases(capsys):
    losses = helloworld.main(["--batch_size", "2", "--num_tokens", "16", "--model_dim", "32", "--hidden_size", "64",
                              "--num_local_experts", "4", "--top", "2", "--num_steps", "4", "--dtype", "float64",
                              "--lr", "1e-2"])
    assert len(losses) == 4 and losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert "STEP-0: loss =" in out and "step_time =" in out and "capacity = " in out


def test_charlm_trains_and_writes_outputs(tmp_path):
    summary = charlm.main(["--steps", "30", "--model_dim", "32", "--hidden_size", "64", "--num_layers", "1",
                           "--context", "32", "--batch_size", "8", "--corpus_bytes", "200000", "--eval_every", "15",
                           "--no_progress", "--out", str(tmp_path)])
    assert summary["final_train_loss"] < summary["initial_loss"] < math.log(256) + 0.5
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"] == 30 and saved["tokens_per_second"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_corpus_is_deterministic_stdlib_source():
    a = charlm.load_corpus(50_000)
    b = charlm.load_corpus(50_000)
    assert len(a) == 50_000 and bool((a == b).all())
    assert b"def " in bytes(a.tolist())
