"""`specdec` CLI on the default model, eager (compiling 30 layers costs minutes here): generate
streams text and reports tokens/s; bench --json reports a row per prompt."""
import json
import shutil

import pytest
import torch

from specdec_inductor import cli

pytest.importorskip("transformers")


def test_console_script_installed():
    assert shutil.which("specdec") is not None


def test_generate_streams_text_and_reports_speed(capsys):
    assert cli.main(["generate", "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "6", "--eager"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out  # greedy SmolLM2-135M-Instruct answers this one
    assert "attention backend: ops" in err and "tokens/s" in err


def test_bench_json(capsys):
    assert cli.main(["bench", "--eager", "--num-prompts", "1", "--repeats", "1",
                     "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["rows"]
    assert row["new_tokens"] == 4 and row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
    assert row["tokens_equal_hf"] is True
    assert result["attention_backend"] == "ops" and result["compiled"] is False


def test_generate_ngram_matches_plain_greedy(capsys):
    prompt = "Repeat exactly: red green blue, red green blue, red green blue."
    assert cli.main(["generate", "--prompt", prompt, "--max-new-tokens", "16", "--eager"]) == 0
    plain = capsys.readouterr().out
    assert cli.main(["generate", "--prompt", prompt, "--max-new-tokens", "16", "--eager",
                     "--method", "ngram", "--num-draft-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == plain.strip()
    assert "mean accepted length" in err


def test_generate_sampled_with_seed_repeats(capsys):
    argv = ["generate", "--prompt", "Name a color.", "--max-new-tokens", "8", "--eager",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--method", "ngram"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first and first.strip()


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "0"),
                                        ("--top-k", "-3")])
def test_generate_rejects_bad_sampling_flags(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", flag, value, "--eager"])
    assert info.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_generate_standalone_with_a_layer_cut_draft(capsys):
    assert cli.main(["generate", "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "6", "--eager", "--method", "standalone",
                     "--draft-layers", "4", "--num-draft-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "first 4 layers" in err and "standalone:" in err


def test_bench_method_reports_speedup_and_acceptance(capsys):
    assert cli.main(["bench", "--eager", "--method", "ngram", "--num-prompts", "1",
                     "--repeats", "1", "--max-new-tokens", "8", "--num-draft-tokens", "4",
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "ngram" and len(result["rows"]) == 1
    row = result["rows"][0]
    assert row["tokens_equal_ar"] is True
    assert row["speedup"] > 0 and row["mean_accepted_length"] >= 1.0
    assert len(row["acceptance_by_position"]) == 3


def test_generate_eagle_with_a_random_head_is_still_exact(tmp_path, capsys):
    from specdec_inductor.loading import load_model
    from specdec_inductor.testing import write_random_eagle_checkpoint
    target, _ = load_model()
    write_random_eagle_checkpoint(str(tmp_path / "eagle"), target.config, scale=0.02)
    assert cli.main(["generate", "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "6", "--eager", "--method", "eagle",
                     "--draft-model", str(tmp_path / "eagle"), "--num-draft-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "EAGLE head" in err


def test_eagle_needs_a_checkpoint(monkeypatch, tmp_path, capsys):
    # Without a shipped head for the model (here: none at all), --draft-model is required.
    from specdec_inductor import loading
    monkeypatch.setattr(loading, "shipped_head", lambda method: str(tmp_path / "none"))
    with pytest.raises(SystemExit) as info:  # the flags' check, before anything loads
        cli.main(["generate", "--eager", "--method", "eagle", "--max-new-tokens", "2"])
    assert info.value.code == 2 and "argument --draft-model:" in capsys.readouterr().err


def test_ngram_window_flag_reaches_the_proposer_and_bad_values_exit():
    args = cli.make_parser().parse_args(["generate", "--method", "ngram", "--ngram-window", "3,6"])
    p = cli.make_proposer(args)
    from specdec_inductor.proposers.ngram import RECOMMENDED_WINDOW
    p.add_request(0, [1, 2, 3, 4, 1, 2])  # a 2-token match only: window 3 drafts nothing
    assert int(p.propose([0], torch.tensor([6])).num_drafts[0]) == 0
    default = cli.make_parser().parse_args(["generate", "--method", "ngram"])
    assert default.ngram_window == ",".join(map(str, RECOMMENDED_WINDOW))
    bad = cli.make_parser().parse_args(["generate", "--method", "ngram", "--ngram-window", "4,2"])
    with pytest.raises(SystemExit, match="argument --ngram-window: needs 1 <= MIN <= MAX"):
        cli.make_proposer(bad)


def test_bf16_speculation_says_greedy_is_not_token_exact(capsys):
    bf16 = cli.make_parser().parse_args(["generate", "--method", "ngram", "--dtype", "bf16"])
    cli.make_proposer(bf16)
    assert "--dtype fp32 for token-exact output" in capsys.readouterr().err
    fp32 = cli.make_parser().parse_args(["generate", "--method", "ngram"])
    cli.make_proposer(fp32)
    assert "token-exact" not in capsys.readouterr().err


def test_no_pack_weights_flag_switches_packing_for_the_run(monkeypatch):
    from specdec_inductor import backend
    seen = []
    monkeypatch.setattr(cli, "cmd_generate",
                        lambda args: seen.append(backend.SWITCH_DEFAULTS["pack_weights"]) or 0)
    assert cli.main(["generate", "--no-pack-weights"]) == 0
    assert cli.main(["generate"]) == 0
    assert seen == [False, True] and backend.SWITCH_DEFAULTS["pack_weights"] is True


def test_lookup_flag_reaches_the_config_on_by_default_for_eagle3_refused_without_a_draft():
    args = cli.make_parser().parse_args(["generate", "--method", "eagle3", "--lookup",
                                         "--ngram-window", "2,6"])
    config = cli.proposer_config(args)
    assert config.lookup is True and config.ngram_window == (2, 6)
    def lookup(*flags):
        return cli.proposer_config(cli.make_parser().parse_args(["generate", *flags])).lookup

    # On by default for EAGLE-3 alone (registry.LOOKUP_BY_DEFAULT); --no-lookup turns it off.
    assert lookup("--method", "eagle3") is True
    assert lookup("--method", "eagle3", "--no-lookup") is False
    assert lookup("--method", "eagle") is False and lookup("--method", "standalone") is False
    assert lookup("--method", "eagle", "--lookup") is True
    assert lookup("--method", "ngram") is False and lookup() is False
    bad = cli.make_parser().parse_args(["generate", "--method", "ngram", "--lookup"])
    with pytest.raises(SystemExit, match="argument --lookup: applies to method"):
        cli.make_proposer(bad)
