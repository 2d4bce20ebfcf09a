"""serve/choices.py: the reasoning splitter, a choice followed through cumulative engine outputs
(deltas, tool-call fragments, finish reason, final message), token texts and the logprobs shapes.

Expectations come from elsewhere: `str.partition` for the reasoning split, the strict
`parse_completion` and `json.dumps` for tool calls, the tokenizer's own decoder for token bytes.
No model, no jax.
"""

import asyncio
import json
import random
import types

import pytest

from dsv4_jax.chat import (
    BOS,
    EOS,
    THINK_END,
    ChatStreamParser,
    ContentDelta,
    ReasoningDelta,
    ReasoningSplitter,
    chat_message,
    chat_parser,
    parse_completion,
    render_tool_calls,
)
from dsv4_jax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from dsv4_jax.engine.sampling_params import SamplingParams
from dsv4_jax.chat.tokenizer import encode_prompt, load_tokenizer
from serve.choices import (
    ChoiceState,
    TextOffsets,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from serve.completions import _Choice
from serve.generation import Generation

# `</th`, `<｜`-like and DSML text in the reasoning and after `</think>` exercise the held-back tail.
SPLIT_TEXT = (
    "Let me think: is </thi a tag? <think> no, </ THINK> neither. 日本語 <"
    f"{THINK_END}"
    f"The answer </think> stays here.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">"
)

REASONING = 'Two cities, so two calls. "</thin" is not an end tag; naïve quoting \\ stays.'
CONTENT = "Checking both cities — one moment."
CALLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "arguments": {"city": 'Île "de" France\nnorth', "days": 3}}},
    {"type": "function", "function": {"name": "convert",
                                      "arguments": {"values": [1.5, {"a": None}], "unit": "°C", "exact": True}}},
]
TOOL_TEXT = REASONING + THINK_END + CONTENT + "\n\n" + render_tool_calls(CALLS)


def random_chunks(text: str, rng: random.Random, pieces: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces, len(text)) - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def chunkings(text: str) -> list[list[str]]:
    """Char by char and three random chunkings (fixed seeds)."""
    return [list(text)] + [random_chunks(text, random.Random(seed), pieces)
                           for seed, pieces in ((0, 5), (1, 17), (2, 60))]


# ---- ReasoningSplitter ----------------------------------------------------------------------------


def split(chunks: list[str]) -> tuple[str, str]:
    """Feed the chunks, then finish; the concatenated reasoning and content."""
    splitter, events = ReasoningSplitter(), []
    for chunk in chunks:
        events += splitter.feed(chunk)
    events += splitter.finish()
    assert all(isinstance(e, (ReasoningDelta, ContentDelta)) and e.text for e in events)
    kinds = [type(e) for e in events]
    assert ContentDelta not in kinds or ReasoningDelta not in kinds[kinds.index(ContentDelta):]
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, ContentDelta)))


def test_reasoning_splitter_matches_partition_at_every_cut():
    reasoning, _, content = SPLIT_TEXT.partition(THINK_END)
    for cut in range(len(SPLIT_TEXT) + 1):
        assert split([SPLIT_TEXT[:cut], SPLIT_TEXT[cut:]]) == (reasoning, content), cut
    for chunks in chunkings(SPLIT_TEXT):
        assert split(chunks) == (reasoning, content)


def test_reasoning_splitter_cut_inside_think_end_emits_no_fragment_of_it():
    head, tail = "abc", " tail"
    for cut in range(1, len(THINK_END)):
        splitter = ReasoningSplitter()
        before = splitter.feed(head + THINK_END[:cut])
        assert before == [ReasoningDelta(head)], cut
        assert splitter.feed(THINK_END[cut:] + tail) == [ContentDelta(tail)], cut
        assert splitter.finish() == []


def test_reasoning_splitter_without_think_end_is_all_reasoning():
    text = "only thoughts, no end tag < / think > </thinking"
    for chunks in chunkings(text):
        assert split(chunks) == (text, "")


def test_reasoning_splitter_partial_think_end_then_finish_is_reasoning():
    splitter = ReasoningSplitter()
    assert splitter.feed("thought </th") == [ReasoningDelta("thought ")]
    assert splitter.finish() == [ReasoningDelta("</th")]


def test_reasoning_splitter_keeps_dsml_after_think_end_as_content():
    dsml = "\n\n" + render_tool_calls(CALLS) + EOS
    for chunks in chunkings("r" + THINK_END + "c" + dsml):
        assert split(chunks) == ("r", "c" + dsml)


# ---- ChoiceState ----------------------------------------------------------------------------------


def engine_outputs(chunks: list[str], finish_reason: str, stop_reason=None, seed: int = 0,
                   with_logprobs: bool = True) -> list[CompletionOutput]:
    """Cumulative outputs as the engine gives them: 0-3 new tokens per step (0 new characters for
    a token that completes no character yet), the last one finished."""
    rng = random.Random(seed)
    text, token_ids, logprobs, outputs = "", [], [], []
    for i, chunk in enumerate(chunks):
        text += chunk
        for _ in range(rng.randint(1 if chunk else 0, 3)):
            token = rng.randrange(128000)
            token_ids.append(token)
            logprobs.append({token: Logprob(-rng.random(), rank=1)})
        last = i == len(chunks) - 1
        outputs.append(CompletionOutput(0, text, list(token_ids), None, list(logprobs) if with_logprobs else None,
                                        finish_reason if last else None, stop_reason if last else None))
    return outputs


def stream(state: ChoiceState, outputs: list[CompletionOutput]) -> list[dict]:
    deltas = []
    for output in outputs:
        assert state.finish_reason is None
        deltas.append(state.advance(output)[0])
    return deltas


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key, "") for d in deltas)


@pytest.mark.parametrize("finish_reason,stop_reason", [("stop", "###"), ("length", None), ("stop", 7)])
def test_choice_without_parser_streams_all_text_as_content(finish_reason, stop_reason):
    text = f"plain <think>x{THINK_END} and \n\n<｜DSML｜tool_calls> stay content"
    state = ChoiceState(0, None)
    deltas = stream(state, engine_outputs(random_chunks(text, random.Random(3), 9) + [""], finish_reason, stop_reason))
    assert all(set(d) <= {"content"} for d in deltas)
    assert joined(deltas, "content") == text
    assert (state.finish_reason, state.stop_reason) == (finish_reason, stop_reason)
    assert state.message(with_reasoning=False) == {"role": "assistant", "content": text, "reasoning": None,
                                                   "reasoning_content": None, "tool_calls": []}


def streamed_tool_calls(deltas: list[dict]) -> dict[int, dict]:
    """Assemble the tool-call fragments per index, checking which fields each fragment carries."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for fragment in delta.get("tool_calls", []):
            index = fragment["index"]
            if index not in calls:
                assert set(fragment) == {"index", "id", "type", "function"}
                assert fragment["type"] == "function" and set(fragment["function"]) == {"name", "arguments"}
                calls[index] = {"id": fragment["id"], "type": "function",
                                "function": {"name": fragment["function"]["name"], "arguments": ""}}
            else:
                assert set(fragment) == {"index", "function"} and set(fragment["function"]) == {"arguments"}
            calls[index]["function"]["arguments"] += fragment["function"]["arguments"]
    return calls


@pytest.mark.parametrize("chunk_index", range(4))
def test_choice_with_tool_calls_streams_what_the_strict_parse_reports(chunk_index):
    expected = parse_completion(TOOL_TEXT + EOS, "thinking")
    assert len(expected["tool_calls"]) == len(CALLS)
    chunks = chunkings(TOOL_TEXT)[chunk_index]
    state = ChoiceState(0, ChatStreamParser("thinking"))
    deltas = stream(state, engine_outputs(chunks, "stop", seed=chunk_index))

    for delta in deltas:
        assert set(delta) <= {"reasoning", "reasoning_content", "content", "tool_calls"}
        assert delta.get("reasoning") == delta.get("reasoning_content")
    assert joined(deltas, "reasoning") == expected["reasoning_content"] == REASONING
    assert joined(deltas, "content") == expected["content"] == CONTENT

    calls = streamed_tool_calls(deltas)
    assert sorted(calls) == [0, 1]
    for index, call in enumerate(CALLS):
        function = calls[index]["function"]
        assert function["name"] == call["function"]["name"]
        assert function["arguments"] == expected["tool_calls"][index]["function"]["arguments"]
        assert function["arguments"] == json.dumps(call["function"]["arguments"], ensure_ascii=False)
    ids = [calls[i]["id"] for i in (0, 1)]
    assert len(set(ids)) == 2 and all(isinstance(i, str) and i for i in ids)

    assert state.finish_reason == "tool_calls" and state.stop_reason is None
    assert state.message(with_reasoning=True) == {
        "role": "assistant", "content": CONTENT, "reasoning": REASONING, "reasoning_content": REASONING,
        "tool_calls": [calls[0], calls[1]]}
    assert state.message(with_reasoning=False)["reasoning"] is None


@pytest.mark.parametrize("chunk_index", range(4))
def test_choice_with_max_one_tool_call_drops_later_calls_everywhere(chunk_index):
    state = ChoiceState(0, ChatStreamParser("thinking"), max_tool_calls=1)
    deltas = stream(state, engine_outputs(chunkings(TOOL_TEXT)[chunk_index], "stop", seed=chunk_index))
    calls = streamed_tool_calls(deltas)
    assert sorted(calls) == [0]
    assert calls[0]["function"]["name"] == CALLS[0]["function"]["name"]
    assert joined(deltas, "content") == CONTENT  # the dropped call does not leak into the text
    message = state.message(with_reasoning=True)
    assert message["tool_calls"] == [calls[0]] and message["content"] == CONTENT
    assert state.finish_reason == "tool_calls"


def test_calls_in_the_last_output_alone_still_make_the_finish_reason_tool_calls():
    """A slow reader gets only the newest output (cumulative): every call may arrive with the stop."""
    for chunks in ([TOOL_TEXT], [TOOL_TEXT[:5], TOOL_TEXT[5:]]):
        state = ChoiceState(0, ChatStreamParser("thinking"))
        stream(state, engine_outputs(chunks, "stop"))
        assert state.finish_reason == "tool_calls" and len(state.tool_calls) == 2


def test_choice_tool_calls_keep_a_length_finish_reason():
    state = ChoiceState(0, ChatStreamParser("thinking"))
    stream(state, engine_outputs(random_chunks(TOOL_TEXT, random.Random(5), 8), "length"))
    assert state.finish_reason == "length" and len(state.message(True)["tool_calls"]) == 2



@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_choice_with_a_call_cut_off_keeps_its_finish_reason_and_leaks_no_markup(finish_reason):
    """A stop string (or max_tokens) inside the second call's `unit` value: the first call whole,
    the second's arguments unclosed, no DSML as content, and "stop" stays "stop" (not
    "tool_calls": the model did not finish its calls)."""
    text = TOOL_TEXT[: TOOL_TEXT.index("°C") + 1]
    state = ChoiceState(0, ChatStreamParser("thinking"))
    deltas = stream(state, engine_outputs(random_chunks(text, random.Random(11), 7), finish_reason))
    calls = streamed_tool_calls(deltas)
    whole = json.dumps(CALLS[0]["function"]["arguments"], ensure_ascii=False)
    assert [c["function"]["arguments"] for c in calls.values()] == [whole, '{"values": [1.5, {"a": null}], "unit": "°']
    assert joined(deltas, "content") == CONTENT and state.message(True)["content"] == CONTENT
    assert state.finish_reason == finish_reason
    # With parallel_tool_calls=false the cut call is not shown: the first, whole, makes it "tool_calls";
    # and so do whole calls whose block's closing tag was cut off.
    for cut_text, max_calls in ((text, 1), (TOOL_TEXT[: TOOL_TEXT.rindex("</")], None)):
        state = ChoiceState(0, ChatStreamParser("thinking"), max_tool_calls=max_calls)
        stream(state, engine_outputs(random_chunks(cut_text, random.Random(12), 7), "stop"))
        assert state.finish_reason == "tool_calls" and len(state.tool_calls) == (max_calls or 2)

@pytest.mark.parametrize("tools_active", [True, False])
@pytest.mark.parametrize("split_reasoning", [True, False])
def test_llm_chat_parse_is_the_servers_for_the_same_text(tools_active, split_reasoning):
    """`LLM.chat` folds a whole text with `chat_message`; the server streams the same text through
    a ChoiceState: one parser choice (`chat_parser`), so the same reasoning, content and calls."""
    cut = TOOL_TEXT[: TOOL_TEXT.index("Île") + 4]  # a call cut off inside its arguments
    for text in (TOOL_TEXT, SPLIT_TEXT, cut, CONTENT + THINK_END + CONTENT, REASONING + EOS, ""):
        whole = chat_message(text, chat_parser(tools_active, split_reasoning))
        state = ChoiceState(0, chat_parser(tools_active, split_reasoning))
        stream(state, engine_outputs(random_chunks(text, random.Random(5), 6) if len(text) > 6 else [text], "stop"))
        served = state.message(with_reasoning=split_reasoning)
        assert (whole["content"], whole["reasoning_content"] if split_reasoning else None) == (
            served["content"] or "", served["reasoning_content"]), text
        assert [c["function"] for c in whole["tool_calls"]] == [c["function"] for c in served["tool_calls"]], text
        assert bool(whole["tool_calls"]) == (tools_active and text in (TOOL_TEXT, cut))


def test_choice_with_splitter_flushes_held_tail_at_finish():
    state = ChoiceState(0, ReasoningSplitter())
    deltas = stream(state, engine_outputs(["thinking about ", "</th"], "length"))
    assert deltas[-1] == {"reasoning": "</th", "reasoning_content": "</th"}
    assert state.message(with_reasoning=True) == {"role": "assistant", "content": "",
                                                  "reasoning": "thinking about </th",
                                                  "reasoning_content": "thinking about </th", "tool_calls": []}


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_choice_advance_returns_exactly_the_new_tokens_and_logprobs(with_logprobs):
    chunks = random_chunks(TOOL_TEXT, random.Random(11), 20)
    chunks[3:3] = ["", ""]  # steps whose tokens complete no character yet
    outputs = engine_outputs(chunks, "stop", seed=11, with_logprobs=with_logprobs)
    state = ChoiceState(0, ChatStreamParser("thinking"))
    seen_tokens, seen_entries = [], []
    previous = 0
    for output in outputs:
        _, new_tokens, entries = state.advance(output)
        count = len(output.token_ids)
        assert new_tokens == output.token_ids[previous:count]
        if with_logprobs:
            assert len(entries) == len(new_tokens)
            assert all(a is b for a, b in zip(entries, output.logprobs[previous:count]))
            seen_entries += entries
        else:
            assert entries is None
        seen_tokens += new_tokens
        previous = count
    assert seen_tokens == outputs[-1].token_ids
    if with_logprobs:
        assert seen_entries == outputs[-1].logprobs


# ---- TokenTexts -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_token_bytes_concatenate_to_the_tokenizer_decode(tokenizer):
    texts = TokenTexts(tokenizer, as_token_ids=False)
    rng = random.Random(1234)
    ids = rng.sample(range(128000), 2000)
    by_id = {i: texts.bytes_of(i) for i in ids}
    assert all(by_id.values())
    # A single token's text: U+FFFD where it holds part of a character, as the decoder shows it.
    assert all(texts.text_of(i) == tokenizer.decode([i], skip_special_tokens=False) for i in ids)
    rng.shuffle(ids)
    for start in range(0, len(ids), 25):
        window = ids[start:start + 25]
        decoded = b"".join(by_id[i] for i in window).decode("utf-8", errors="replace")
        assert decoded == tokenizer.decode(window, skip_special_tokens=False), window
    assert b"".join(by_id[i] for i in ids).decode("utf-8", errors="replace") == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("special", [THINK_END, EOS, BOS])
def test_special_token_bytes_are_its_own_utf8(tokenizer, special):
    token_id = tokenizer.token_to_id(special)
    assert token_id is not None
    texts = TokenTexts(tokenizer, as_token_ids=False)
    assert texts.bytes_of(token_id) == special.encode("utf-8")
    assert texts.text_of(token_id) == special


def test_token_texts_as_token_ids(tokenizer):
    texts = TokenTexts(tokenizer, as_token_ids=True)
    for token_id in (*tokenizer.encode("Héllo wörld").ids, tokenizer.token_to_id(THINK_END)):
        assert texts.text_of(token_id) == f"token_id:{token_id}"
        assert texts.bytes_of(token_id) == tokenizer.decode([token_id], skip_special_tokens=False).encode()


# ---- chat_logprobs / completion_logprobs ------------------------------------------------------------


@pytest.fixture(scope="module")
def logprob_case(tokenizer):
    """Three sampled tokens with hand-made entries (dict order deliberately not rank order), and
    the expected (text, logprob) alternatives per token for top=2."""
    sampled = tokenizer.encode("Hello world!").ids
    alt = tokenizer.encode(" the a of to and in").ids
    assert len(sampled) == 3 and len(set(alt)) == 6 and not set(alt) & set(sampled)
    text = lambda t: tokenizer.decode([t], skip_special_tokens=False)
    entries = [
        # sampled at rank 2 among the top: listed between rank 1 and rank 3 is cut
        {alt[1]: Logprob(-2.5, rank=3), sampled[0]: Logprob(-0.9, rank=2), alt[0]: Logprob(-0.6, rank=1)},
        # sampled at rank 5: not among the two alternatives; a -inf alternative is clamped
        {sampled[1]: Logprob(-7.0, rank=5), alt[3]: Logprob(float("-inf"), rank=2), alt[2]: Logprob(-0.1, rank=1),
         alt[4]: Logprob(-3.0, rank=3)},
        # sampled with -inf logprob at rank 1
        {alt[5]: Logprob(-1.0, rank=2), sampled[2]: Logprob(float("-inf"), rank=1)},
    ]
    sampled_logprobs = [-0.9, -7.0, -9999.0]
    top2 = [[(alt[0], -0.6), (sampled[0], -0.9)], [(alt[2], -0.1), (alt[3], -9999.0)],
            [(sampled[2], -9999.0), (alt[5], -1.0)]]
    return sampled, entries, sampled_logprobs, top2, text


@pytest.mark.parametrize("top", [0, 1, 2])
def test_chat_logprobs(tokenizer, logprob_case, top):
    sampled, entries, sampled_logprobs, top2, text = logprob_case
    items = chat_logprobs(TokenTexts(tokenizer, as_token_ids=False), sampled, entries, top)
    assert items == [
        {"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
         "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": list(text(a).encode())} for a, alp in alts[:top]]}
        for t, lp, alts in zip(sampled, sampled_logprobs, top2)
    ]


# top_logprobs of completions: the token itself first, then the alternatives of rank <= top (vLLM's
# _create_completion_logprobs over the engine's {sampled, top-k} entry; OpenAI's legacy completions
# return up to logprobs + 1 entries, the sampled token among them).
COMPLETION_TOP = {
    0: [["s0"], ["s1"], ["s2"]],
    1: [["s0", "a0"], ["s1", "a2"], ["s2"]],
    2: [["s0", "a0"], ["s1", "a2", "a3"], ["s2", "a5"]],
}


@pytest.mark.parametrize("as_token_ids", [False, True])
@pytest.mark.parametrize("top", [0, 1, 2])
def test_completion_logprobs(tokenizer, logprob_case, as_token_ids, top):
    sampled, entries, sampled_logprobs, top2, text = logprob_case
    shown = (lambda t: f"token_id:{t}") if as_token_ids else text
    out = completion_logprobs(TokenTexts(tokenizer, as_token_ids), sampled, entries, top, text_offsets=[17, 19, 23])
    assert out["tokens"] == [shown(t) for t in sampled]
    assert out["token_logprobs"] == sampled_logprobs
    alt = tokenizer.encode(" the a of to and in").ids
    names = {**{f"s{i}": t for i, t in enumerate(sampled)}, **{f"a{i}": t for i, t in enumerate(alt)}}
    logprob_of = {t: lp for alts in top2 for t, lp in alts} | dict(zip(sampled, sampled_logprobs))
    assert [list(d.items()) for d in out["top_logprobs"]] == [
        [(shown(names[n]), logprob_of[names[n]]) for n in row] for row in COMPLETION_TOP[top]]
    assert out["text_offset"] == [17, 19, 23]


# ---- completions' text_offset ---------------------------------------------------------------------


def _cumulative(tokenizer, prompt_ids, ids, logprobs: bool = True) -> list[RequestOutput]:
    """The engine's cumulative outputs, one token per step; the text holds back an incomplete
    character (as the engine's detokenizer) and skips special tokens."""
    outputs = []
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd")
        entries = [{t: Logprob(-1.0, rank=1)} for t in ids[:k]] if logprobs else None
        last = k == len(ids)
        outputs.append(RequestOutput("r", None, prompt_ids, [None, *({t: Logprob(-2.0, rank=1)} for t in prompt_ids[1:])],
                                     [CompletionOutput(0, text, list(ids[:k]), None, entries,
                                                       "stop" if last else None, None)], last))
    return outputs


def _expected_offsets(tokenizer, ids: list[int], start: int, skip_special: bool = True) -> list[int]:
    """Each token's offset as the decoder places it: the length of the text the tokens before it
    decode to, an incomplete last character left out."""
    return [start + len(tokenizer.decode(ids[:i], skip_special_tokens=skip_special).rstrip("\ufffd"))
            for i in range(len(ids))]


def test_completion_text_offsets_after_an_unfinished_character(tokenizer):
    """Token 5000 is the first two bytes of a three-byte character and "bit" cannot finish it: the
    text shows U+FFFD there (the tokenizer's lossy decoding), and "bit" sits after it."""
    texts = TokenTexts(tokenizer, as_token_ids=False)
    ids = [4000, 5000, 6000, 4000]  # "AD", b"\xe0\xa8", "bit", "AD"
    text = tokenizer.decode(ids)
    assert text == "AD\ufffdbitAD"
    assert TextOffsets(texts, 0).of(ids, len(text), lambda t: False) == [0, 2, 3, 6]
    # Token 104 (b"\xa8") finishes it: one character "\u0a28" from two tokens, both at its start.
    assert tokenizer.decode([4000, 5000, 104, 4000]) == "AD\u0a28AD"
    assert TextOffsets(texts, 0).of([4000, 5000, 104, 4000], 5, lambda t: False) == [0, 2, 2, 3]


@pytest.mark.parametrize("token_prompt", [False, True])
def test_completion_text_offsets_index_the_echoed_and_generated_text(tokenizer, token_prompt):
    """The echoed prompt (BOS not in its text) and the generated tokens (a character split over
    two tokens, EOS skipped): every offset indexes the returned text, never decreasing, and each
    token's text sits at its offset; the same whether the outputs are read one by one or only
    the last (a slow reader's coalesced stream gives the same logprobs)."""
    prompt = "Héllo wörld"
    prompt_ids = encode_prompt(tokenizer, prompt)
    generated = [*tokenizer.encode(" 😀 naïve", add_special_tokens=False).ids, tokenizer.token_to_id(EOS)]
    assert any("\ufffd" in tokenizer.decode([t]) for t in generated)  # the emoji spans tokens
    outputs = _cumulative(tokenizer, prompt_ids, generated)
    echo = tokenizer.decode(prompt_ids, skip_special_tokens=True) if token_prompt else prompt
    texts = TokenTexts(tokenizer, as_token_ids=False)
    results = []
    for feed in (outputs, outputs[-1:], outputs[::3] + outputs[-1:]):
        choice = _Choice(0, echo, not token_prompt, skip_special_tokens=True, prompt_tokens=len(prompt_ids))
        pieces = [choice.advance(out, texts, 1) for out in feed]
        results.append(("".join(text for text, _ in pieces), choice.logprobs))
    assert results[1] == results[0] == results[2]
    text, logprobs = results[0]
    assert text == prompt + " 😀 naïve"
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] <= len(text)
    n = len(prompt_ids)
    assert offsets[:n] == _expected_offsets(tokenizer, prompt_ids, 0)
    assert offsets[n:] == _expected_offsets(tokenizer, generated, len(prompt))
    for token, offset in zip([*prompt_ids, *generated], offsets):
        piece = tokenizer.decode([token], skip_special_tokens=True)
        assert "\ufffd" in piece or text[offset:offset + len(piece)] == piece, (token, piece, offset)


# ---- the merged output stream of a request's choices -------------------------------------------


class _FakeEngine:
    """An `EngineClient` whose add_request streams `steps` cumulative outputs per request, as fast as
    it can (a yield to the loop between steps), as an engine far ahead of a slow client."""

    def __init__(self, tokenizer, generated: list[int], steps: int):
        self.outputs = _cumulative(tokenizer, [0], generated)[:steps]
        self.outputs[-1].metrics = RequestMetrics(1.0, 2.0, 3.0, 4.0)  # the engine's timestamps, at the end
        self.num_waiting, self.max_model_len = 0, 256
        self.aborted: list[str] = []

    def add_request(self, rid, prompt_ids, params, forced=None):
        async def stream():
            for out in self.outputs:
                yield out
                await asyncio.sleep(0)
        return stream()

    def abort_now(self, rid):
        self.aborted.append(rid)


def test_a_server_default_max_tokens_is_capped_to_each_prompts_room_and_a_sent_one_is_not(tokenizer):
    """`Generation(cap_to_room=True)`: the server's default max_tokens beyond what max_model_len
    leaves a prompt becomes None (the engine's "what is left"), prompt by prompt, for every child."""
    engine = _FakeEngine(tokenizer, [5], steps=1)
    engine.max_model_len = 64
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, ids, params, forced=None: (seen.append(params.max_tokens), add(rid, ids, params))[1]
    state = types.SimpleNamespace(engine=engine, metrics=_Metrics(), args=types.SimpleNamespace(max_waiting_requests=16))
    prompts = [[0] * 10, [0] * 60]  # rooms of 54 and 4
    for cap, expected in ((True, [16, 16, None, None]), (False, [16] * 4)):
        seen.clear()
        Generation(state, "c", prompts, SamplingParams(n=2, max_tokens=16), cap_to_room=cap).close()
        assert seen == expected, cap


class _Metrics:
    def __init__(self):
        self.generated, self.finished, self.parents, self.phases = {}, {}, [], {}

    def request_started(self, rid, prompt_len):
        self.generated[rid] = 0

    def tokens_generated(self, rid, count):
        self.generated[rid] += count

    def request_finished(self, rid, reason, *, phases=None, max_tokens=None):
        self.finished[rid] = reason
        self.phases[rid] = (phases, max_tokens)

    def parent_finished(self, n, max_generation_tokens):
        self.parents.append((n, max_generation_tokens))


def test_a_slow_reader_gets_only_the_newest_output_of_each_choice(tokenizer):
    """Outputs are cumulative, so a reader slower than the engine gets each choice's newest output
    (fewer, larger steps) instead of a queue of every step, each holding the whole text so far; the
    deltas, logprobs and token counts it builds are those of reading every step."""
    generated = tokenizer.encode(" a slow reader " * 40, add_special_tokens=False).ids
    engine = _FakeEngine(tokenizer, generated, steps=len(generated))
    state = types.SimpleNamespace(engine=engine, metrics=_Metrics(),
                                  args=types.SimpleNamespace(max_waiting_requests=16))
    texts = TokenTexts(tokenizer, as_token_ids=False)

    async def read() -> tuple[list[int], list[_Choice]]:
        generation = Generation(state, "cmpl", [[0]], SamplingParams(n=2, logprobs=1))
        choices = [_Choice(i, None, False, True, 1) for i in range(2)]
        delivered = [0, 0]
        async for index, out in generation.outputs():
            delivered[index] += 1
            choices[index].advance(out, texts, 1)
            for _ in range(20):  # the reader is slow: the engine makes ~20 steps meanwhile
                await asyncio.sleep(0)
        return delivered, choices

    delivered, choices = asyncio.run(read())
    assert all(count <= len(generated) // 5 for count in delivered), delivered
    every = _Choice(0, None, False, True, 1)
    for out in engine.outputs:
        every.advance(out, texts, 1)
    for choice in choices:
        assert "".join(choice.text) == "".join(every.text) == tokenizer.decode(generated)
        assert choice.logprobs == every.logprobs and choice.finish_reason == "stop"
    assert state.metrics.generated == {"cmpl-0-0": len(generated), "cmpl-0-1": len(generated)}
    assert state.metrics.finished == {"cmpl-0-0": "stop", "cmpl-0-1": "stop"} and not engine.aborted
    assert state.metrics.parents == [(2, len(generated))]  # one prompt, observed once both choices ended
    # Each finished child hands on its last output's engine timestamps and its max_tokens (16, the default).
    assert state.metrics.phases == {rid: (engine.outputs[-1].metrics, 16) for rid in ("cmpl-0-0", "cmpl-0-1")}


def test_a_chat_stream_sends_its_role_chunks_with_the_first_output(tokenizer):
    """As vLLM's server: nothing goes out before the engine's first output, then each choice's role
    chunk and the text. A client that times its first chunk (vLLM's `bench serve` does) measures
    the time to the first token, not the HTTP round trip."""
    from serve.chat import _stream
    from serve.protocol import ServerLimits, parse_chat_request

    generated = tokenizer.encode(" hello there", add_special_tokens=False).ids
    engine = _FakeEngine(tokenizer, generated, steps=len(generated))
    engine.outputs = _cumulative(tokenizer, [0], generated, logprobs=False)  # as the engine without logprobs
    release = asyncio.Event()
    ungated = engine.add_request

    def add_request(rid, prompt_ids, params, forced=None):  # no output until released
        inner = ungated(rid, prompt_ids, params)

        async def stream():
            await release.wait()
            async for out in inner:
                yield out
        return stream()

    engine.add_request = add_request
    state = types.SimpleNamespace(engine=engine, metrics=_Metrics(),
                                  args=types.SimpleNamespace(max_waiting_requests=16))
    req = parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], "stream": True, "n": 2},
                             ServerLimits(("m",), tokenizer.get_vocab_size()))
    plan = types.SimpleNamespace(request=req, prompt_ids=[0])

    async def read() -> list[dict]:
        generation = Generation(state, "chatcmpl-x", [[0]], req.params)
        stream = _stream(state, plan, "chatcmpl-x", 0, generation, [ChoiceState(i, None, None) for i in range(2)],
                         TokenTexts(tokenizer, as_token_ids=False))
        first = asyncio.ensure_future(stream.__anext__())
        for _ in range(50):
            await asyncio.sleep(0)
        assert not first.done(), first.result()  # nothing before the first output
        release.set()
        return [await first] + [chunk async for chunk in stream]

    chunks = asyncio.run(read())
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    for index in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[2:] if c["choices"][0]["index"] == index)
        assert text == tokenizer.decode(generated)


def test_a_request_refused_between_its_choices_leaves_no_parent_metrics(tokenizer):
    """The engine refuses one choice's add: those added are aborted, the response is a 400, and no
    prompt-level observation (n, longest choice) is made for prompts whose choices never completed;
    a max_tokens left out is what max_model_len leaves the prompt."""
    from serve.protocol import OpenAIError

    for prompts, refused, aborted in (([[0]], 2, ["c-0-0"]), ([[0], [0, 1]], 3, ["c-0-0", "c-0-1"])):
        engine = _FakeEngine(tokenizer, [5], steps=1)
        add, calls = engine.add_request, []

        def add_request(rid, prompt_ids, params, forced=None):
            calls.append(rid)
            if len(calls) == refused:
                raise ValueError("refused by the engine")
            return add(rid, prompt_ids, params)

        engine.add_request = add_request
        state = types.SimpleNamespace(engine=engine, metrics=_Metrics(),
                                      args=types.SimpleNamespace(max_waiting_requests=16))
        with pytest.raises(OpenAIError, match="refused by the engine"):
            Generation(state, "c", prompts, SamplingParams(n=2, max_tokens=None))
        assert state.metrics.finished == {rid: "abort" for rid in aborted} and engine.aborted == aborted
        assert state.metrics.parents == []
        assert {max_tokens for _, max_tokens in state.metrics.phases.values()} == {engine.max_model_len - 1}
