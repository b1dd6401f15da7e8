"""POST /tokenize and POST /detokenize in vLLM's shapes. /tokenize takes a `prompt` (text) or
chat `messages` (rendered as /v1/chat/completions renders them) and answers the ids the
generation endpoints would feed the model: `tokens`, `count`, `max_model_len` (and `token_strs`
with `return_token_strs`). /detokenize takes `tokens` and answers the decoded `prompt`."""
from __future__ import annotations

from runtime.server.protocol import Body, bad, check_model, is_int, refuse_unsupported

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                   "chat_template_kwargs", "tools", "tool_choice", "reasoning_effort"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _no_tokenizer(fe) -> None:
    if fe.tokenizer is None:
        raise bad("this model has no tokenizer: there is nothing to tokenize or detokenize with")


def tokenize(fe, b: Body) -> dict:
    refuse_unsupported(b, TOKENIZE_FIELDS)
    check_model(b, fe.names)
    _no_tokenizer(fe)
    if b.get_bool("add_special_tokens", False):
        # the generation endpoints add none, and these are their ids
        raise bad("'add_special_tokens': true is not supported: the server adds no special tokens to a prompt",
                  "add_special_tokens", "unsupported_parameter")
    if ("prompt" in b) == ("messages" in b):
        raise bad("/tokenize takes exactly one of 'prompt' and 'messages'", "prompt")
    if "prompt" in b:
        ids = fe.tokenizer.encode(b.get_as("prompt", "", str))
    else:
        from runtime.server.chat import parse_messages, protocol_options
        from v41.chat_format import ChatFormatError
        try:
            ids = parse_messages(fe, b, protocol_options(fe, b))
        except ChatFormatError as e:
            raise bad(f"chat protocol: {e}", e.param) from None
    out = {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids, "token_strs": None}
    if b.get_bool("return_token_strs", False):
        out["token_strs"] = [fe.codec.token_str(t) for t in ids]
    return out


def detokenize(fe, b: Body) -> dict:
    refuse_unsupported(b, DETOKENIZE_FIELDS)
    check_model(b, fe.names)
    _no_tokenizer(fe)
    ids = b.get("tokens")
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < fe.vocab_size for t in ids):
        raise bad(f"'tokens' must be a list of token ids in [0, {fe.vocab_size})", "tokens")
    return {"prompt": fe.codec.decode(ids)}
