import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax import sample
from nvfp4_jax.config import make_config, save_json
from nvfp4_jax.train.build import build_model


def test_next_token_greedy_top_k_and_temperature():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0, 2.5, -1.0])
    assert sample.next_token(logits, temperature=0.0, top_k=0, rng=rng) == 1
    assert {sample.next_token(logits, temperature=5.0, top_k=1, rng=rng) for _ in range(50)} == {1}
    draws = np.array([sample.next_token(logits, temperature=1.0, top_k=2, rng=rng) for _ in range(4000)])
    assert set(draws.tolist()) == {1, 3}
    # Top-2 renormalised softmax: p(1) = 1 / (1 + e^-0.5) = 0.6225; 4000 draws: sd 0.0077.
    assert abs((draws == 1).mean() - 1 / (1 + np.exp(-0.5))) < 0.03
    hot = np.array([sample.next_token(logits, temperature=2.0, top_k=0, rng=rng) for _ in range(4000)])
    p = np.exp(logits / 2) / np.exp(logits / 2).sum()
    # Sampling noise, not rounding: each frequency's sd is at most 0.008, so 0.03 is ~4 sd.
    np.testing.assert_allclose(np.bincount(hot, minlength=5) / 4000, p, atol=0.03)


def test_generation_reads_the_last_position_of_a_sliding_right_padded_window():
    vocab, length = 97, 4
    calls = []

    def logits_fn(tokens_1xL):  # causal: position t sees tokens 0..t; predicts their sum
        calls.append(tokens_1xL.copy())
        sums = np.cumsum(tokens_1xL[0])
        return np.eye(vocab)[sums % vocab] * 10

    got = sample.generate(logits_fn, [5, 7], length=length, max_new_tokens=5, temperature=0.0, top_k=0, seed=0)
    ids = [5, 7]
    for token in got:
        assert token == sum(ids[-length:]) % vocab
        ids.append(token)
    np.testing.assert_array_equal(calls[0], [[5, 7, 0, 0]])  # the prompt, right-padded
    np.testing.assert_array_equal(calls[-1], [ids[-5:-1]])  # the last 4 ids once the window is full
    assert sample.generate(logits_fn, [5, 7], length=length, max_new_tokens=5, temperature=0.0, top_k=0, seed=0,
                           eos_id=got[2]) == got[:2]
    # Ids past the tokenizer's are never drawn, however likely.
    assert all(t < 50 for t in sample.generate(logits_fn, [5, 7], length=length, max_new_tokens=8, temperature=0.0,
                                               top_k=0, seed=0, num_ids=50))
    # Sampling is a function of the seed.
    hot = dict(length=length, max_new_tokens=6, temperature=50.0, top_k=0)
    assert sample.generate(logits_fn, [1], seed=3, **hot) == sample.generate(logits_fn, [1], seed=3, **hot)
    assert sample.generate(logits_fn, [1], seed=3, **hot) != sample.generate(logits_fn, [1], seed=4, **hot)


@pytest.mark.slow
def test_bf16_greedy_generation_is_the_argmax_of_the_unpadded_model():
    cfg = make_config({"model_name": "tiny", "base_num_decoder_layers": 1, "max_target_length": 8,
                       "base_emb_dim": 64, "base_mlp_dim": 128})
    model = build_model(cfg.model, quantized=False)
    params = jax.jit(model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda p: p * 4, nn.meta.unbox(params))  # sharper logits: no near-ties
    prompt = np.array([72, 101, 108, 108, 111, 32, 119])
    got = sample.generate(sample.bf16_logits(cfg, params), prompt, length=8, max_new_tokens=4, temperature=0.0,
                          top_k=0, seed=0)
    # Reference: the 7 prompt tokens unpadded (generate pads them to the window of 8), then the
    # last 8 tokens as the window slides.
    reference = jax.jit(lambda p, tokens: model.apply({"params": p}, tokens)[0, -1])
    ids = list(prompt)
    for token in got:
        assert token == int(jnp.argmax(reference(params, jnp.asarray([ids[-8:]], jnp.int32))))
        ids.append(token)


def test_run_tokenizer_follows_the_runs_data_keys(tmp_path):
    stream = make_config({"dataset_type": "shakespeare"})
    tok, add_bos, stop = sample.run_tokenizer(stream)
    assert tok.kind == "bytes" and not add_bos and not stop  # byte windows have no BOS/EOS
    docs = make_config({"dataset_type": "grain", "grain_train_files": "x.array_record", "add_eos": False})
    assert sample.run_tokenizer(docs)[1:] == (True, False)
    # A pre-tokenized stream decodes with the tokenizer the config names, without BOS/EOS.
    path = tmp_path / "tiny.tiktoken"
    import base64

    path.write_bytes(b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256)))
    ids = make_config({"dataset_type": "tokens", "dataset_path": "x.bin", "tokenizer_type": "tiktoken",
                       "tokenizer_path": str(path)})
    tok, add_bos, stop = sample.run_tokenizer(ids)
    assert tok.kind == "tiktoken" and tok.vocab_size == 258 and not add_bos and not stop


@pytest.mark.parametrize("setup, args, message", [
    ("none", [], r"is not a run directory: it has no config.json"),
    ("config", [], r"has no checkpoints/ folder"),
    ("config", ["--temperature", "-1"], r"--temperature=-1.0 is not allowed: must be 0 \(greedy\) or a finite "
                                        r"number >= 1e-06"),
    # 1e-320 is a float, but logits / 1e-320 overflow and softmax becomes NaN.
    ("config", ["--temperature", "1e-320"], r"--temperature=1e-320 is not allowed: must be 0 \(greedy\) or a finite"),
    ("config", ["--temperature", "inf"], r"--temperature=inf is not allowed"),
    ("config", ["--temperature", "nan"], r"--temperature=nan is not allowed"),
    ("config", ["--seed", "-1"], r"--seed=-1 is not allowed: must be an integer >= 0"),
    # Undecodable argv bytes reach Python as lone surrogates (surrogateescape).
    ("config", ["--prompt", b"To \xff be".decode("utf-8", "surrogateescape")],
     r"--prompt is not valid UTF-8 text: bytes b'\\xff' at character 3 do not decode"),
    ("config", ["--top-k", "x"], r"argument --top-k: invalid int value: 'x'"),
    ("tokenizer", [], r"tokenizer_path='tok.json' does not exist\. \(the run's tokenizer; give its path with --tokenizer"),
])
def test_sample_user_errors_are_one_line_exit_2(tmp_path, capsys, setup, args, message):
    run = tmp_path / "run"
    if setup in ("config", "tokenizer"):
        run.mkdir()
        keys = {"dataset_type": "hf", "hf_train_files": "x.jsonl", "tokenizer_type": "huggingface",
                "tokenizer_path": "tok.json"} if setup == "tokenizer" else {}
        save_json(make_config(keys), str(run / "config.json"))
    assert sample.main([str(run), "--prompt", "To be", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    import re

    assert re.search(message, err[0]), err


# A damaged checkpoint leaves orbax read coroutines behind; they are reported, not raised.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_is_named_in_one_warning_with_the_one_used(tmp_path, capsys):
    from nvfp4_jax.train import assembly, checkpoint

    cfg = make_config({"model_name": "tiny", "base_num_decoder_layers": 1, "max_target_length": 16,
                       "base_emb_dim": 32, "base_mlp_dim": 64, "base_num_query_heads": 2,
                       "base_num_kv_heads": 2, "head_dim": 16})
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_json(cfg, str(run / "config.json"))
    state = assembly.assemble(cfg, jax.devices()[:1], check_batch=False).init_state(seed=0)
    manager = checkpoint.make_manager(str(run / "checkpoints"), max_to_keep=3)
    for step in (1, 2):
        checkpoint.save(manager, state.replace(step=jnp.asarray(step, jnp.int32)), {"step": step})
    manager.close()
    files = [os.path.join(r, f) for r, _, names in os.walk(run / "checkpoints" / "2" / "state") for f in names]
    os.remove(max(files, key=os.path.getsize))  # the newest checkpoint loses its largest file

    assert sample.main([str(run), "--prompt", "To be", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("warning: skipped the damaged checkpoint step 2 (")
    assert warnings[0].endswith("; sampling from step 1, the newest intact one.")
    assert any(line.startswith("[checkpoint step 1 of ") for line in err)
