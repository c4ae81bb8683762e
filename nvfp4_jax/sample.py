"""`python -m nvfp4_jax.sample RUN_DIR --prompt "..." [options]`: text from a run's newest checkpoint.

  --prompt TEXT          the text to continue (document runs start it with BOS when add_bos);
                         a VLM run's question about its image
  --image PATH           model_type=vlm: the image to ask about, a .npy array ([S, S] or [S, S, C];
                         integers divided by 255, floats kept) or a PNG, of the run's image_size
                         and image_channels
  --image-index N        model_type=vlm: instead, the N-th held-out image of the run's dataset;
                         the line on stderr names it and its reference answer to the prompt
  --max-new-tokens N     tokens to generate (default 200); stops early at EOS, a VLM's at "\\n"
  --temperature T        0 (default): greedy; a finite T >= 1e-06 samples from softmax(logits / T)
  --top-k K              sample among the K likeliest tokens only (0: all)
  --seed S               the sampling seed, an integer >= 0 (default 0)
  --tokenizer PATH       the tokenizer file, when the run's tokenizer_path is not found from here
  --debug                the traceback above an `error:` line (as NVFP4_JAX_DEBUG=1)

The run's `config.json` gives the model and the tokenizer (a `grain`/`hf` run's tokenizer keys;
bytes for the byte corpora). The forward pass is BF16 with plain dots (the parameters are the
same whatever the training recipe), over the last `max_target_length` tokens (a VLM's: the
text tokens its rows hold after the image's). A prompt must be valid UTF-8 text (an argument
with undecodable bytes is refused). When the newest checkpoint is damaged, the next newest
intact one is used, after one `warning: ...` line naming both. Exit codes: 0 done, 2 a user
error, 4 no intact checkpoint (each one `error: ...` line).

A VLM run (`model_type=vlm`) takes exactly one of `--image` and `--image-index` (a text run
neither) and prints only the answer: the prompt is formatted as training formats a question
(`prompt + " "`, after the image's tokens) and the answer ends at its "\\n", as the held-out VQA's
(`train/vqa.py`; its `vqa_accuracy` is measured with the training recipe's dots, these are BF16).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import numpy as np

from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail, parse_command
from nvfp4_jax.config import Config, ConfigError
from nvfp4_jax.config.choices import DOCUMENT_DATASET_TYPES
from nvfp4_jax.train.run_dir import read_run_config

# The smallest temperature but 0 (greedy): logits / T, computed in float64 from float32 logits
# (|logit| < 3.5e38), stays finite for every T >= 1e-6, so softmax never becomes NaN; below it
# sampling is greedy for every practical purpose anyway.
MIN_TEMPERATURE = 1e-6


def _parser() -> CommandParser:
    parser = CommandParser("sample", error=ConfigError)
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="")
    parser.add_argument("--image", default=None)
    parser.add_argument("--image-index", type=int, default=None)
    return parser


def _check_utf8(prompt: str) -> None:
    """ConfigError for a prompt that is not UTF-8 text: Python hands on an argument's undecodable
    bytes as lone surrogates (surrogateescape), which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = prompt[exc.start:exc.end].encode("utf-8", "surrogateescape")
        raise ConfigError(f"--prompt is not valid UTF-8 text: bytes {raw!r} at character {exc.start} "
                          "do not decode; give the prompt as UTF-8.") from None


def run_tokenizer(cfg: Config, tokenizer_path: str = ""):
    """(tokenizer, add_bos, stop_at_eos) the run's data was made with; `tokenizer_path` replaces
    the config's (a relative one is relative to where training started)."""
    # config errors come back before jax loads
    from nvfp4_jax.data import DataError, load_tokenizer

    d = cfg.data
    try:
        tokenizer = load_tokenizer(d.tokenizer_type, tokenizer_path or d.tokenizer_path)
    except DataError as exc:
        raise DataError(f"{exc} (the run's tokenizer; give its path with --tokenizer PATH)") from None
    documents = d.dataset_type in DOCUMENT_DATASET_TYPES
    return tokenizer, documents and d.add_bos, documents and d.add_eos


def chosen_image(cfg: Config, prompt: str, path: str | None, index: int | None) -> tuple[np.ndarray, str] | None:
    """A VLM run's image: `--image PATH` or `--image-index N` (exactly one), as float32 `[S, S, C]`
    pixels of the run's image_size and image_channels, and a line saying which image it is. None
    for a text run, which takes neither."""
    # config errors come back before jax loads
    from nvfp4_jax.data import DataError
    from nvfp4_jax.data.image_text import read_image

    m = cfg.model
    given = [f"--image {path!r}"] * (path is not None) + [f"--image-index {index}"] * (index is not None)
    if m.model_type != "vlm":
        if given:
            raise ConfigError(f"{' and '.join(given)}: this run's model_type={m.model_type!r} reads text only; "
                              "an image is for a model_type='vlm' run.")
        return None
    if len(given) != 1:
        raise ConfigError(f"{' and '.join(given)}: give one of them, not both." if given else
                          "this run is a VLM (model_type='vlm'): give the image to ask about, --image PATH "
                          "(a .npy or .png file) or --image-index N (a held-out image of the run's dataset).")
    if path is not None:
        try:
            pixels = read_image(path)
        except DataError as exc:
            raise ConfigError(f"--image: {exc}") from None
        what, about = f"--image {path!r}", f"image {os.path.abspath(path)}"
    else:
        pixels, what, about = held_out_image(cfg, index, prompt)
    shape = (m.image_size, m.image_size, m.image_channels)
    if pixels.shape != shape:
        raise ConfigError(f"{what} is {pixels.shape} (height, width, channels), but this run's model reads "
                          f"{shape} (image_size={m.image_size}, image_channels={m.image_channels}).")
    return np.asarray(pixels, np.float32), about


def held_out_image(cfg: Config, index: int, prompt: str) -> tuple[np.ndarray, str, str]:
    """(pixels, its name in an error, the line about it) of the `index`-th image of the run's
    held-out split (image_batches.split_images, as training split it), the line with its reference
    answer to `prompt` where the dataset asks it that, else the questions it does ask."""
    # config errors come back before jax loads
    from nvfp4_jax.data.image_batches import split_images
    from nvfp4_jax.data.image_text import image_source

    name, images, examples = image_source(cfg.data)
    held_out = split_images(images, cfg.data.eval_fraction, cfg.train.seed)["eval"]
    if not 0 <= index < len(held_out):
        raise ConfigError(f"--image-index={index} is out of range: the run's held-out split of {name} has "
                          f"{len(held_out)} images, numbered 0 to {len(held_out) - 1}.")
    image = int(held_out[index])
    asked = [e for e in examples if e.image == image]
    answers = [e.answer for e in asked if e.prompt == prompt]
    reference = (f"reference answer {answers[0]!r}" if answers else "no reference answer to this prompt; "
                 f"the dataset asks it {', '.join(repr(e.prompt) for e in asked)}")
    return (images[image], f"held-out image {index} ({name} image {image})",
            f"held-out image {index} of {len(held_out)}: {name} image {image}; {reference}")


def next_token(logits_V: np.ndarray, *, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature) over the top k."""
    logits_V = np.asarray(logits_V, np.float64)
    if temperature == 0:
        return int(np.argmax(logits_V))
    scaled_V = logits_V / temperature
    if 0 < top_k < len(scaled_V):
        kth = np.partition(scaled_V, -top_k)[-top_k]
        scaled_V = np.where(scaled_V >= kth, scaled_V, -np.inf)
    p_V = np.exp(scaled_V - scaled_V.max())
    return int(rng.choice(len(p_V), p=p_V / p_V.sum()))


def load_params(run_dir: str, cfg: Config):
    """(params, step) of the newest intact checkpoint, restored on one device."""
    # config errors come back before jax loads
    from nvfp4_jax.train.run_params import newest_params

    return newest_params(run_dir, cfg, use="sampling")


def bf16_logits(cfg: Config, params, image_SxSxC: np.ndarray | None = None):
    """`logits(tokens_1xL) -> fp32 logits_LxV`: the model with plain BF16 dots, jitted once; a
    VLM's reads `image_SxSxC` ahead of the text."""
    # config errors come back before jax loads
    import jax
    import jax.numpy as jnp

    from nvfp4_jax.train.build import build_model

    model = build_model(dataclasses.replace(cfg.model, dtype="bfloat16"), quantized=False)
    images = () if image_SxSxC is None else (jnp.asarray(image_SxSxC)[None],)
    forward = jax.jit(lambda p, tokens_1xL, *images: model.apply({"params": p}, tokens_1xL, *images)[0])
    return lambda tokens_1xL: np.asarray(forward(params, jnp.asarray(tokens_1xL), *images), np.float32)


def generate(logits_fn, prompt_ids, *, length: int, max_new_tokens: int, temperature: float, top_k: int,
             seed: int, eos_id: int | None = None, num_ids: int | None = None) -> list[int]:
    """New token ids after `prompt_ids`, one call of `logits_fn` per token on the last `length` ids,
    right-padded to `length` (a causal model never looks at the padding). Only ids below
    `num_ids` (the tokenizer's) are drawn: a model vocabulary padded past the tokenizer's has
    rows no text decodes to."""
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in prompt_ids]
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = ids[-length:]
        tokens_1xL = np.zeros((1, length), np.int32)
        tokens_1xL[0, :len(window)] = window
        logits_V = logits_fn(tokens_1xL)[len(window) - 1][:num_ids]
        token = next_token(logits_V, temperature=temperature, top_k=top_k, rng=rng)
        if eos_id is not None and token == eos_id:
            break
        ids.append(token)
        new.append(token)
    return new


def main(argv: list[str] | None = None) -> int:
    # config errors come back before jax loads
    from nvfp4_jax.data import DataError
    from nvfp4_jax.data.image_batches import ANSWER_END, prompt_ids
    from nvfp4_jax.train.checkpoint import CheckpointError

    try:
        args = parse_command(_parser(), argv, __doc__)
        if args is None:
            return Exit.OK
        t = args.temperature
        for name, ok, allowed in (
                ("--max-new-tokens", args.max_new_tokens > 0, "must be > 0"),
                ("--temperature", t == 0 or (math.isfinite(t) and t >= MIN_TEMPERATURE),
                 f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (logits / temperature "
                 "must stay finite)"),
                ("--top-k", args.top_k >= 0, "must be >= 0"),
                ("--seed", args.seed >= 0, "must be an integer >= 0")):
            if not ok:
                raise ConfigError(f"{name}={getattr(args, name[2:].replace('-', '_'))} is not allowed: {allowed}.")
        _check_utf8(args.prompt)
        cfg = read_run_config(args.run_dir)
        tokenizer, add_bos, stop_at_eos = run_tokenizer(cfg, args.tokenizer)
        image = chosen_image(cfg, args.prompt, args.image, args.image_index)
        if image is None:
            ids = tokenizer.encode(args.prompt, add_bos=add_bos)
            stop_id = tokenizer.eos_id if stop_at_eos else None
            if not len(ids):
                raise ConfigError("--prompt is empty and this run's documents have no BOS to start from; "
                                  "give a prompt.")
        else:  # as training rows hold a question: its bytes and " ", the answer after; "\n" ends it
            ids, stop_id = prompt_ids(args.prompt), ord(ANSWER_END)
            if len(ids) >= cfg.model.text_length:
                raise ConfigError(f"--prompt is {len(ids)} bytes with the ' ' after it, but this run's rows hold "
                                  f"{cfg.model.text_length} text tokens (max_target_length - image tokens): "
                                  "shorten it to leave room for the answer.")
        params, step = load_params(args.run_dir, cfg)
    except (ConfigError, DataError, CheckpointError) as exc:
        return fail(exc, Exit.NO_CHECKPOINT if isinstance(exc, CheckpointError) else Exit.BAD_INPUT,
                    debug=debug_requested(argv))

    pixels, about = image or (None, tokenizer.describe())
    new = generate(bf16_logits(cfg, params, pixels), ids, length=cfg.model.text_length,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed, eos_id=stop_id, num_ids=tokenizer.vocab_size)
    print(f"[checkpoint step {step} of {os.path.abspath(args.run_dir)}; {about}]", file=sys.stderr)
    shown = new if image is not None else np.concatenate([ids, new])  # an answer; a prompt and its continuation
    print(tokenizer.decode(np.asarray(shown, np.int64)), flush=True)
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
