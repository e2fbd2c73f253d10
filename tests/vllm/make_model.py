"""Writes a tiny Llama model directory that vLLM serves with `--load-format dummy` (random
weights, nothing read), so the suite needs no model hub:

    python tests/vllm/make_model.py DIR

- `config.json`: LlamaForCausalLM, hidden 128, 2 layers, 4 heads (head dim 32), 2 KV heads,
  intermediate 256, vocab 1024.
- `tokenizer.json`: a byte-level BPE trained here with the `tokenizers` library on a fixed text
  (one thread: the same files on every run), 1024 entries with the ChatML special tokens.
- `tokenizer_config.json`: `PreTrainedTokenizerFast` with a ChatML chat template.
"""

import json
import os
import sys
from pathlib import Path

VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Made-up words of two to four syllables, drawn by a fixed linear congruential generator: the
# same text, and so the same merges, on every run, and varied enough to fill the vocabulary.
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def corpus() -> list[str]:
    state, lines = 12345, []

    def draw(n: int) -> int:
        nonlocal state
        state = (state * 1103515245 + 12345) % 2**31
        return (state >> 8) % n

    for _ in range(4000):
        words = []
        for _ in range(12):
            syllables = 2 + draw(3)
            words.append("".join(_CONSONANTS[draw(len(_CONSONANTS))] + _VOWELS[draw(len(_VOWELS))]
                                 for _ in range(syllables)))
        lines.append(" ".join(words) + ".")
    return lines


def config(eos_id: int, bos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def make_model(out: Path) -> Path:
    # Before the import: the trainer's thread pool reads it once.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() > VOCAB:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, more than {VOCAB}")

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "config.json").write_text(
        json.dumps(config(eos_id=ids["<|im_end|>"], bos_id=ids["<|im_start|>"]), indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_model.py DIR")
    print(make_model(Path(sys.argv[1])))
