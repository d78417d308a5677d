import string

import torch
import transformers

from services.trainer.models import TinyQwen3Config, build_tokenizer, padded_vocab_size


def test_tokenizer_round_trips_ascii_and_has_special_tokens(tmp_path):
    tok = build_tokenizer()
    text = string.printable + "Hello, world!\n  {\"a\": [1, 2]}\t~`|\\ done"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == special
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert again.chat_template == tok.chat_template


def test_chat_template_renders_two_turns_with_a_tool_message():
    tok = build_tokenizer()
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4+4?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n")
    assert "<|im_start|>user\nWhat is 2+3?<|im_end|>\n" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert "<|im_start|>assistant\n5<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_model_builds_as_qwen3():
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = TinyQwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, intermediate_size=128).build(padded_vocab_size(tok), tok.eos_token_id)
    assert isinstance(model, transformers.Qwen3ForCausalLM)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size >= len(tok)
    assert next(model.parameters()).dtype == torch.float32
    out = model(input_ids=torch.tensor([tok.encode("1+2=", add_special_tokens=False)]))
    assert out.logits.shape[-1] == model.config.vocab_size
