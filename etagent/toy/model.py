"""The tiny policy: a byte-level BPE tokenizer trained on the toy text and a small Qwen2 model.

The tokenizer uses Qwen2's own pre-tokenizer (its split regex, then byte-level) so that
``AutoTokenizer`` reloading the folder reproduces the same token ids. The protocol's tags, and
the whole system prompt, are single added tokens (not special: decoding keeps them); the chat
markers ``<|im_start|>`` and ``<|im_end|>`` are special tokens, ``<|im_end|>`` is EOS and
``<|endoftext|>`` pads, as in Qwen2. The chat template is ChatML.

Copying is what the toy policy has to learn (a name from the question into a query, a number from
a result into code or the answer), and a tiny model learns to copy a token long before it learns
to copy a token sequence that looks different in every context. So every word the toy world makes
up (names, professions) is one token wherever it appears, whether a space, ``{``, ``"``, a tag
or a newline precedes it; Qwen2's pre-tokenizer alone would glue that preceding character to the
word. Numbers are split into chunks of up to three digits from the left (``1873`` -> ``187 3``), as
GPT-4's tokenizer does, instead of Qwen2's single digits: a 6-digit result is two tokens to copy,
not six near-identical ones. Both are added tokens, matched before pre-tokenization, so the
property does not depend on the pre-tokenizer (tested over the whole toy corpus).

The model is a Qwen2 architecture with randomly initialised weights: it knows nothing until SFT
trains it. Its attention head size must be one vLLM's CPU kernels accept (32, 64, 80, ...).

What this module does not do: train the model (``sft/``) or generate (``etagent.llm``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from etagent import protocol

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"

# Qwen2's pre-tokenizer split pattern: contractions, letters, single digits, punctuation runs,
# newlines and spaces. Reproducing it is what keeps ids stable when transformers reloads the
# tokenizer as Qwen2Tokenizer.
QWEN2_SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Every string of one to three digits ("7", "07", "007", ...): with leftmost-longest matching of
# added tokens, a run of digits splits into three-digit chunks from the left.
DIGIT_CHUNKS = [f"{i:0{width}d}" for width in (1, 2, 3) for i in range(10**width)]


def train_tokenizer(texts: Iterable[str], vocab_size: int, words: Iterable[str] = ()):
    """A byte-level BPE tokenizer for the toy text, wrapped for transformers; each of ``words``
    (whole words only) and each digit chunk is one token wherever it appears."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in protocol.TAG_STRINGS])
    # single_word: a name never matches inside a longer word (a city named after a river).
    tokenizer.add_tokens([AddedToken(word, special=False, normalized=False, single_word=True) for word in sorted(set(words))])
    tokenizer.add_tokens([AddedToken(chunk, special=False, normalized=False) for chunk in DIGIT_CHUNKS])
    # The system prompt is the same in every sequence; as one token it costs the tiny model
    # nothing to read, and every sequence gets about 380 tokens shorter (most of the CPU time
    # of SFT and RL on the toy world). Text and ids still round-trip exactly.
    tokenizer.add_tokens([AddedToken(protocol.SYSTEM_PROMPT, special=False, normalized=False)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def build_model(
    tokenizer,
    *,
    hidden_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate_size: int,
    max_positions: int,
    seed: int,
    token_classes: Iterable[Iterable[int]] = (),
):
    """A randomly initialised Qwen2 causal LM sized for the tokenizer (vocab = len(tokenizer)).

    Each group of ids in ``token_classes`` (the toy world's made-up words, the digit chunks)
    starts with one random direction shared by its embeddings, as large as each embedding's own
    random part. A pretrained model knows that an unseen name is a name; a model from scratch
    sees each of 600 names a few times and has to learn that about every one of them before it
    can learn to copy them. With the shared part, "attend to the name in the question" and
    "write a name here" work for every name from the first step, and SFT only has to learn the
    copying itself. Tied embeddings carry the same part into the output layer.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by heads {heads}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        for ids in token_classes:
            embeddings[list(ids)] += torch.randn(hidden_size) * config.initializer_range
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return model


def save_policy(model, tokenizer, out_dir: str | Path) -> Path:
    """Save model and tokenizer as one ``save_pretrained`` folder (safetensors)."""
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    hf_logging.disable_progress_bar()  # a 1 MB model needs no progress bar in the demo output
    try:
        model.save_pretrained(out)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    return out
