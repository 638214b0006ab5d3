"""Tiny random Llama models made at test time (no download), and Hugging Face references."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512


def make_model(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama with head_dim 64 (vLLM's CPU attention rejects 16), float32 safetensors.

    Its logits are nearly flat, so greedy choices have margins of ~1e-2: a float32 engine matches
    the float32 reference token for token; a bf16 engine does not always (see the bf16 test).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_reference(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy completion; like vLLM it ends with EOS (included) when EOS is the argmax."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def token_logprobs(model: LlamaForCausalLM, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) under the reference, by teacher forcing."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(completion)), torch.tensor(completion)].tolist()


# A chat template in the style of real ones: roles as special tokens, `raise_exception` on an
# unknown role, the tools handed to the template, and a template kwarg (`enable_thinking`).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|> tools:{% for t in tools %} {{ t.function.name }}{% endfor %} <|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}"
    "<|{{ m.role }}|> {{ m.content }}{% if not loop.last or m.role != 'assistant' %} <|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking %} <|think|>{% endif %}{% endif %}"
)
CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
                 "<|end|>", "<|think|>"]


def make_chat_model(path: Path, *, seed: int = 0) -> Path:
    """The tiny model plus a word-level tokenizer over its whole vocabulary ("w9" .. "w511" and
    the special tokens above, ids 0..8) and a chat template: a model vLLM's server can chat with."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_model(path, seed=seed)
    vocab = {name: i for i, name in enumerate(CHAT_SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(CHAT_SPECIALS), VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True) for t in CHAT_SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def make_lora(base: Path, out: Path, *, seed: int, r: int = 8, targets=("q_proj", "v_proj")):
    """A PEFT LoRA adapter of `base`, saved to `out` (PEFT's save_pretrained), with random
    non-zero lora_B (PEFT starts it at zero, which would change nothing). Returns the
    transformers model with the adapter merged: the float32 reference of that adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_reference(base), LoraConfig(r=r, lora_alpha=2 * r,
                                                           target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.save_pretrained(out)
    return model.merge_and_unload().eval()


# --- a scripted model: its weights spell fixed tool calls -----------------------------------------

# Each chain starts at a prompt's last token and follows `SCRIPTS[start]` token by token, then EOS.
# Every token is the piece of one script only (a token has one successor in a first-order chain).
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCRIPTS = {
    # two hermes calls (parallel), after a user turn
    "<|assistant|>": ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                      "</tool_call>", "\n<tool_call>",
                      '{"name": "get_weather", "arguments": {"city": "Tokyo"}}', "</tool_call>\n"],
    # the final answer, after tool results
    "<|after_tool|>": ["It is", " sunny in", " both cities."],
    # a hermes call whose JSON is broken: the parser cannot read it
    "<|broken|>": ['<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>'],
    # a pythonic call (vLLM's `pythonic` parser)
    "<|pythonic|>": ["[get_weather(", "city='Paris'", ")]"],
    # Real chat templates' families (`FAMILY_TEMPLATES`), each started by the last token of its
    # generation prompt and ended by its own end-of-turn token (a stop token of the model's
    # generation config, as in the models these templates come from).
    # ChatML / Qwen3: thinks, then one hermes call, then <|im_end|>
    "assistant\n": ["<think>\n", "Paris then", " Tokyo.", "\n</think>\n\n", "<tool_call>\n",
                    '{"name": "get_weather", "arguments": {"city": "Lyon"}}', "\n</tool_call>", "<|im_end|>"],
    # Llama 3: one call, then <|eot_id|>
    "\n\n": ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "<|eot_id|>"],
    # Gemma: one call, then <end_of_turn>
    "model\n": ['<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
                "<end_of_turn>"],
}
END_TOKENS = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>"]
"""Stop tokens of the tool model besides </s> (its generation config's `eos_token_id`)."""
TOOL_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>",
                 *(start for start in SCRIPTS if start.startswith("<|"))]
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{%- elif m.content is string %}{{ m.content }}{% endif %}"
    "{%- if not (loop.last and m.role == 'assistant' and not add_generation_prompt) %}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if messages[-1].role == 'tool' %}<|after_tool|>{% else %}<|assistant|>{% endif %}{% endif %}"
)


# Templates of three families, as their models' templates render (tools in the system prompt,
# tool calls in the hermes format the tool model spells), for requests' `chat_template`.
QWEN3_TEMPLATE = (
    # Qwen3's: ChatML, each message closed by "<|im_end|>\n"; tools in the system prompt; an
    # assistant message's thinking (from its content's <think>...</think>) kept only after the last
    # user query; tool results as <tool_response> in a user turn.
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n\n<tools>' }}{%- for tool in tools %}"
    "{{- '\n' }}{{- tool | tojson }}{%- endfor %}{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not "
    "(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}"
    "{%- set content = '' %}{%- endif %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]"
    ".lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'"
    " + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}"
    "{%- set call = tool_call.function %}"
    "{{- '<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
_CALLS = ("{%- for tc in m.tool_calls or [] %}{{- '<tool_call>{\"name\": \"' + tc.function.name + "
          "'\", \"arguments\": ' }}{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
          "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}{{- '}</tool_call>' }}{%- endfor %}")
LLAMA3_TEMPLATE = (
    # Llama 3's: a header per message, each closed by <|eot_id|> alone; tool results as `ipython`.
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\n\nTools: ' }}{{- tools | tojson }}"
    "{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\n\n' }}"
    "{%- if m.tool_calls %}" + _CALLS + "{%- else %}{{- m.content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
GEMMA_TEMPLATE = (
    # Gemma's: turns closed by "<end_of_turn>\n" (text after the special end token); the
    # assistant is `model`, tool results come as user turns.
    "{{- bos_token }}"
    "{%- if tools %}{{- '<start_of_turn>user\nTools: ' }}{{- tools | tojson }}{{- '<end_of_turn>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\n' }}"
    "{%- if m.tool_calls %}" + _CALLS + "{%- else %}{{- m.content }}{%- endif %}{{- '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
FAMILY_TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "gemma": GEMMA_TEMPLATE}
CHATML_TEMPLATE = (
    # Plain ChatML (Qwen2.5's without tools): every message as it is, closed by "<|im_end|>\n".
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def make_tool_model(path: Path) -> Path:
    """A Llama whose argmax chain spells `SCRIPTS`, with a byte-level BPE tokenizer trained here
    (`make_scripted_model`); `END_TOKENS` stop it too, as its generation config says."""
    corpus = [" ".join(piece for pieces in SCRIPTS.values() for piece in pieces),
              '{"type": "object", "properties": {"city": {"type": "string"}}} The weather in a city.']
    return make_scripted_model(path, SCRIPTS, TOOL_SPECIALS, TOOL_TEMPLATE, corpus, 360, stops=END_TOKENS)


# A thinking model: deepseek_r1's and qwen3's <think> ... </think>, as added (non-special) tokens.
REASONING_SCRIPTS = {
    "<|assistant|>": ["<think>", "Two and", " two make", " four.", "</think>", "The answer", " is 4."],
    # no thinking markers at all (a token has one successor: no script shares a piece)
    "<|rambling|>": ["Hmm", " and", " hmm"],
}
REASONING_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *REASONING_SCRIPTS]
REASONING_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if ramble %}<|rambling|>{% else %}<|assistant|>{% endif %}"
    "{%- endif %}"
)


def make_reasoning_model(path: Path) -> Path:
    """A scripted model that thinks, then answers, after a user turn (`REASONING_SCRIPTS`); with
    the template kwarg `ramble` it says words without thinking markers."""
    corpus = [" ".join(piece for pieces in REASONING_SCRIPTS.values() for piece in pieces)]
    return make_scripted_model(path, REASONING_SCRIPTS, REASONING_SPECIALS, REASONING_TEMPLATE, corpus, 300)


def make_scripted_model(path: Path, scripts: dict[str, list[str]], specials: list[str], template: str,
                        corpus: list[str], bpe_vocab: int, stops: list[str] = ()) -> Path:
    """A Llama whose argmax chain spells `scripts`, with a byte-level BPE tokenizer trained here.

    Attention and MLP outputs are zero, so each position's logits depend on its own token only:
    embeddings are one-hot, and lm_head maps each script token to its successor (logit sqrt(H))
    and every token to EOS by default (logit sqrt(H)/2). The generation prompt ends with
    <|assistant|>, or <|after_tool|> after tool results, so a tool loop calls, then answers; a
    prompt ending with <|broken|> or <|pythonic|> (continue_final_message) runs those scripts
    (for `SCRIPTS`; `REASONING_SCRIPTS` likewise).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=bpe_vocab, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    pieces = [p for ps in [*scripts.values(), list(scripts)] for p in ps if p not in specials]
    core.add_tokens([AddedToken(p, normalized=False, special=False) for p in dict.fromkeys(pieces)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", chat_template=template)
    tokenizer.save_pretrained(path)
    vocab = len(tokenizer)
    hidden = -(-vocab // 64) * 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=hidden // 64, num_key_value_heads=1,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    eos = tokenizer.convert_tokens_to_ids("</s>")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        head = torch.zeros(vocab, hidden)
        head[eos, :vocab] = 0.5
        for start, chain in scripts.items():
            ids = tokenizer.convert_tokens_to_ids([start, *chain])
            for a, b in zip(ids, ids[1:]):
                head[b, a] = 1.0
            head[eos, ids[-1]] = 1.0
        model.lm_head.weight.copy_(head)
    if stops:  # vLLM stops on every eos_token_id of the generation config
        model.generation_config.eos_token_id = [eos, *tokenizer.convert_tokens_to_ids(list(stops))]
    model.save_pretrained(path)
    return path
