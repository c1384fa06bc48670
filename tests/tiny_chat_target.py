"""A tiny random chat model saved as a transformers model directory, built offline in seconds.

The workflow test points ``target.source`` at it, so that every stage runs the
real loading path (``Target.load`` → ``AutoTokenizer`` / ``AutoModelForCausalLM``)
on a model small enough for a 2-core machine:

- a byte-level BPE tokenizer trained with ``tokenizers`` on a few hundred strings,
  with ChatML special tokens (``<|im_start|>``, ``<|im_end|>``) and unused special
  tokens, the highest of which becomes the drafter's mask token;
- a ChatML chat template; ``<|im_end|>`` is the end-of-sequence token, as in
  SmolLM2 and Qwen chat models;
- a random 6-layer Llama (hidden 64) over that vocabulary.

``build_tiny_inputs`` writes everything ``config/test.yaml`` reads: the model
directory and two prompt files.

    python tests/tiny_chat_target.py tiny      # tiny/target, tiny/prompts.jsonl, tiny/eval_prompts.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash.preflight.synthetic import TINY_SHAPE

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
UNUSED = [f"<|unused_{i}|>" for i in range(4)]
SPECIAL_TOKENS = [PAD, BOS, EOS, *UNUSED]

# The package's tiny shape, over this tokenizer's vocabulary.
TINY_LLAMA = {k: v for k, v in TINY_SHAPE.items() if k != "vocab_size"} | dict(num_hidden_layers=6, max_position_embeddings=1024, tie_word_embeddings=False)

_WORDS = (
    "the a an of to in on for with by from model token draft block target layer speculative decoding "
    "python function return list string number write explain why how what when which small large fast "
    "slow cache train test data prompt answer question code file read print sort sum value key map "
    "hello world please help me with this problem thanks tell story about cat dog tree river city"
).split()


def training_corpus(size: int = 400) -> list[str]:
    """A few hundred deterministic sentences and code lines: enough for the BPE to learn common merges."""
    lines = []
    for i in range(size):
        words = [_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(3 + i % 9)]
        sentence = " ".join(words)
        lines.append(sentence.capitalize() + ("?" if i % 3 == 0 else "."))
        if i % 4 == 0:
            lines.append(f"def {words[0]}_{i}(x):\n    return x + {i}\n")
    return lines


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE wrapped as a ``PreTrainedTokenizerFast`` with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=UNUSED,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_chat_target(out_dir: str | Path, seed: int = 0, **shape) -> Path:
    """Save a random tiny Llama (``shape`` over the tiny shape) and its ChatML tokenizer into ``out_dir``; returns ``out_dir``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        **(TINY_LLAMA | shape),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


TRAIN_PROMPTS = [
    "Write a python function that returns the sum of a list.",
    "Explain why the sky looks blue.",
    "Tell me a short story about a cat and a dog.",
    "How do I read a file in python?",
    "What is speculative decoding?",
    "Sort this list: 3, 1, 2.",
    "Write hello world in python.",
    "Please help me with this problem: a train leaves a city at noon.",
    "Which is larger, 7 or 9?",
    "Explain what a cache is.",
    "Write a function to map keys to values.",
    "Tell me about the river in the city.",
    "Write a function that sorts a list of numbers.",
    "Why is a cache fast?",
    "Tell me a story about a tree by the river.",
    "How do I print a string in python?",
]
EVAL_PROMPTS = ["What is a draft model?", "Write a test for a sort function.", "Tell me about trees."]


def build_tiny_inputs(directory: str | Path, seed: int = 0, **shape) -> Path:
    """``target/`` (the tiny chat model), ``prompts.jsonl`` (``prompt`` records) and ``eval_prompts.jsonl``
    (``messages`` records with a system turn) under ``directory``, as ``config/test.yaml`` expects."""
    directory = Path(directory)
    build_tiny_chat_target(directory / "target", seed=seed, **shape)
    with open(directory / "prompts.jsonl", "w") as f:
        for prompt in TRAIN_PROMPTS:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    with open(directory / "eval_prompts.jsonl", "w") as f:
        for prompt in EVAL_PROMPTS:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIRECTORY")
    print(build_tiny_inputs(sys.argv[1]))
