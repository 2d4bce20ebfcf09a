"""Constrained decoding through the real engine (`chat_llm`: a one-layer random model with the real
129,280-token vocabulary, shared with the server tests): every constrained answer of a random model
sampled at temperature 1 is valid (JSON schemas checked with `jsonschema`, regexes with `re`, choices,
Lark and GBNF grammars by their languages), with steps overlapped or not, beside unconstrained rows,
through a preemption, with reasoning before the grammar, and a failing grammar ends its request
alone. `allowed_token_ids`, `bad_words` and `truncate_prompt_tokens` keep vLLM's meaning."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from dsv4_jax import SamplingParams
from dsv4_jax.chat.tokens import THINK_END, THINK_START
from dsv4_jax.engine import structured_outputs as so_module
from dsv4_jax.engine.request import RequestRejected
from dsv4_jax.engine.structured_outputs import StructuredOutputsConfig, StructuredOutputsParams

SEEDS = range(12)
# A bounded schema: every answer a random model writes under it ends within a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": -5, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["w"], "additionalProperties": False},
    },
    "required": ["color", "count", "ok", "tags", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(chat_llm):
    yield chat_llm
    engine = chat_llm.engine
    assert not engine.has_unfinished() and not engine.num_compiling


def _prompt(llm, text: str = "Answer:") -> dict:
    return {"prompt_token_ids": llm.get_tokenizer().encode(text)}


def _generate(llm, params: list[SamplingParams], prompt: dict | None = None):
    outs = llm.generate([prompt or _prompt(llm)] * len(params), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_idle(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.num_compiling and not engine.scheduler.has_unfinished()
    for manager in engine.scheduler.block_managers:
        manager.check_invariants()
        assert manager.num_free_blocks == manager.num_compressed_blocks
        assert manager.num_free_slots == manager.num_seq_slots


def _constrained(seed: int, max_tokens: int = 120, **kind) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


@pytest.mark.parametrize("overlap", [True, False], ids=["async", "sync"])
def test_every_json_schema_answer_stops_and_validates(llm, monkeypatch, overlap):
    """Twelve seeds at temperature 1, all in one batch (the grammar rows' masks filled together),
    with steps overlapped (the mask of step n + 1 waits for token n while the forward of n + 1 is
    already queued) and one at a time: each answer stops by the grammar's end and validates."""
    monkeypatch.setattr(llm.engine, "async_scheduling", overlap)
    overlapped = []
    step = llm.engine.step

    def watched():
        out = step()
        overlapped.append(llm.engine._in_flight is not None)
        return out

    monkeypatch.setattr(llm.engine, "step", watched)
    params = [_constrained(seed, json=SCHEMA, disable_any_whitespace=True) for seed in SEEDS]
    outs = _generate(llm, params)
    assert any(overlapped) == overlap
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in outs}) > len(outs) // 2  # sampled, not one fixed answer
    _assert_idle(llm)


def test_regex_choice_lark_and_gbnf_answers_are_in_their_languages(llm):
    """Each kind of constraint, several seeds each, one mixed batch: every answer is a word of its
    language, checked independently (`re.fullmatch`, membership)."""
    cases = [
        ({"regex": r"(ab|cd){1,3}-[0-9]{2}"}, lambda t: re.fullmatch(r"(ab|cd){1,3}-[0-9]{2}", t)),
        ({"choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
        ({"grammar": 'start: "(" item ("," item)* ")"\nitem: /[xyz]/ | start'},
         lambda t: re.fullmatch(r"[()xyz,]+", t) and _balanced(t)),
        ({"grammar": 'root ::= "id-" [0-9] [0-9]? ("!" | "?")'}, lambda t: re.fullmatch(r"id-[0-9]{1,2}[!?]", t)),
    ]
    params, checks = [], []
    for kind, check in cases:
        for seed in range(5):
            params.append(_constrained(seed, max_tokens=60, **kind))
            checks.append(check)
    for out, check, p in zip(_generate(llm, params), checks, params):
        if p.structured_outputs.kind == "grammar" and "start" in p.structured_outputs.grammar:
            # Nesting is unbounded: a length stop is allowed, but the text is a prefix of the language.
            assert out.finish_reason in ("stop", "length") and re.fullmatch(r"[()xyz,]+", out.text), out.text
            if out.finish_reason == "stop":
                assert check(out.text), out.text
            continue
        assert out.finish_reason == "stop" and check(out.text), (p.structured_outputs, out.text)


def _balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def test_json_object_answers_are_objects(llm):
    """`json_object` constrains to any JSON object; a bias towards closing quotes and braces makes
    the random model end its strings, so the answers stop, and each is a JSON object."""
    tok = llm.get_tokenizer().backend
    closing = {tok.token_to_id(t): 12.0 for t in ('"', '"}', "}", '":"', '","') if tok.token_to_id(t) is not None}
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=150, logit_bias=closing,
                             structured_outputs=StructuredOutputsParams(json_object=True,
                                                                        disable_any_whitespace=True))
              for seed in range(6)]
    for out in _generate(llm, params):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


def test_unconstrained_rows_beside_constrained_ones_are_untouched(llm):
    """A batch mixing constrained and free rows: the free rows give exactly what they give alone
    (seeded rows draw from their own key; the mask rows of free rows allow everything)."""
    free = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True, logprobs=2) for i in range(3)]
    alone = _generate(llm, free)
    mixed = _generate(llm, [*free, *[_constrained(seed, choice=["a", "b"]) for seed in range(3)]])
    for a, b in zip(alone, mixed[:3]):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:  # batch composition may move a near tie only
                gap = sorted((lp.logprob for lp in a.logprobs[i].values()), reverse=True)
                assert gap[0] - gap[1] <= 1e-3
                break
    assert all(out.text in ("a", "b") and out.finish_reason == "stop" for out in mixed[3:])


def test_reasoning_comes_before_the_grammar_unless_enabled_in_reasoning(llm, monkeypatch):
    """A prompt in thinking mode (ending with `<think>`): the grammar starts after the model's own
    `</think>` (a bias makes the random model write it first), so the answer is `</think>` then a
    choice. With `enable_in_reasoning` the grammar binds from the first token, `</think>` included
    in nothing it allows."""
    tok = llm.get_tokenizer().backend
    think_end = tok.token_to_id(THINK_END)
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Question") + [tok.token_to_id(THINK_START)]}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, logit_bias={think_end: 40.0},
                             skip_special_tokens=False, structured_outputs={"choice": ["alpha", "beta"]})
              for s in range(3)]
    for out in _generate(llm, params, prompt):
        assert out.token_ids[0] == think_end and out.finish_reason == "stop"
        assert out.text.removeprefix(THINK_END) in ("alpha", "beta"), out.text
    monkeypatch.setattr(llm.engine, "structured_outputs_config", StructuredOutputsConfig(enable_in_reasoning=True))
    for out in _generate(llm, params, prompt):
        assert think_end not in out.token_ids and out.text in ("alpha", "beta"), out.text


def test_a_failing_grammar_ends_its_request_alone(llm, monkeypatch):
    """A grammar whose compile fails on the worker (after validation) or is late ends that
    request alone with finish_reason "error" and a message; its neighbours finish normally."""
    real = so_module.GrammarCompiler._matcher
    release = threading.Event()

    def matcher(self, grammar):
        if "failing" in grammar:
            raise ValueError("failing on purpose")
        if "slow" in grammar:
            release.wait(10)
        return real(self, grammar)

    monkeypatch.setattr(so_module.GrammarCompiler, "_matcher", matcher)
    monkeypatch.setattr(llm.engine, "structured_outputs_config", StructuredOutputsConfig(compile_timeout_s=0.3))
    params = [_constrained(0, choice=["failing"]), _constrained(1, choice=["slow"]),
              _constrained(2, choice=["fine"]), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    outs = llm.generate([_prompt(llm)] * 4, params, use_tqdm=False)
    release.set()
    failed, late, fine, free = outs
    assert failed.outputs[0].finish_reason == "error" and "failing on purpose" in failed.error
    assert late.outputs[0].finish_reason == "error" and "did not compile within 0.3 s" in late.error
    assert (fine.outputs[0].text, fine.outputs[0].finish_reason, fine.error) == ("fine", "stop", None)
    assert len(free.outputs[0].token_ids) == 5 and free.error is None
    _assert_idle(llm)


def test_aborts_free_constrained_requests_while_compiling_and_mid_answer(llm):
    """Aborted while its grammar compiles and in the middle of its answer: nothing stays held."""
    engine = llm.engine
    ids = llm.get_tokenizer().encode("x")
    engine.add_request("compiling", ids, _constrained(0, json=SCHEMA))
    engine.abort("compiling")
    engine.add_request("mid", ids, _constrained(1, max_tokens=200, regex="[a-z]{150}"))
    for _ in range(6):
        engine.step()
    out = engine.abort("mid")
    assert out.outputs[0].finish_reason == "abort" and re.fullmatch("[a-z]*", out.outputs[0].text)
    while engine.has_unfinished():
        engine.step()
    _assert_idle(llm)


def test_logprobs_of_a_constrained_step_are_those_of_the_masked_logits(llm):
    """The mask comes before the logprobs: the top logprobs list only allowed tokens (the others
    are -inf), and the allowed ones share all the probability."""
    (out,) = _generate(llm, [SamplingParams(temperature=1.0, seed=3, max_tokens=4, logprobs=5,
                                            structured_outputs={"choice": ["ab", "cd"]})])
    first = out.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > -np.inf}
    texts = {llm.get_tokenizer().decode([t]) for t in finite}
    assert texts <= {"a", "ab", "c", "cd"}, texts
    assert abs(np.logaddexp.reduce(list(finite.values())) - 0.0) <= 1e-4


def test_invalid_constraints_are_refused_naming_the_field(llm):
    ids = llm.get_tokenizer().encode("x")
    cases = [({"json": {"type": "strin"}}, "structured_outputs.json"), ({"regex": "a(("}, "structured_outputs.regex"),
             ({"grammar": "start: nowhere"}, "structured_outputs.grammar"),
             ({"json": {"type": "string", "format": "no-such-format"}}, "structured_outputs.json"),
             ({"json_object": True, "whitespace_pattern": "(("}, "structured_outputs.whitespace_pattern")]
    for kind, field in cases:
        with pytest.raises(RequestRejected) as error:
            llm.engine.add_request("bad", ids, SamplingParams(structured_outputs=kind))
        assert error.value.param == field
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):  # nested too deep to parse
        StructuredOutputsParams(json="[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="'guidance'"):
        StructuredOutputsConfig(backend="xgrammar")
    _assert_idle(llm)


def test_allowed_token_ids_bad_words_and_truncation_keep_vllms_meaning(llm):
    """`allowed_token_ids`: only those; `bad_words`: the word's tokens never follow each other (and
    a one-token word never appears); `truncate_prompt_tokens`: the last k prompt tokens."""
    tok = llm.get_tokenizer()
    allowed = [tok.backend.token_to_id(t) for t in ("a", "b", "c", "Ġthe")]
    (out,) = _generate(llm, [SamplingParams(temperature=1.0, seed=1, max_tokens=20, allowed_token_ids=allowed)])
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 20
    word = tok.encode(" the", add_special_tokens=False)
    assert len(word) == 1
    favour = {word[0]: 30.0, tok.backend.token_to_id("hello"): 30.0}
    free, banned = _generate(llm, [SamplingParams(temperature=0.0, max_tokens=8, logit_bias=favour, ignore_eos=True),
                                   SamplingParams(temperature=0.0, max_tokens=8, logit_bias=favour, ignore_eos=True,
                                                  bad_words=["the", "hello world"])])
    assert word[0] in free.token_ids and word[0] not in banned.token_ids
    long = tok.encode("one two three four five six", add_special_tokens=False)
    (kept,) = llm.generate([{"prompt_token_ids": long}], SamplingParams(max_tokens=1, truncate_prompt_tokens=3),
                           use_tqdm=False)
    assert kept.prompt_token_ids == long[-3:]
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([{"prompt_token_ids": long}], SamplingParams(max_tokens=1, truncate_prompt_tokens=10_000),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([{"prompt_token_ids": long}], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(allowed_token_ids=[])
    eos = llm.engine.eos_token_ids[0]
    with pytest.raises(RequestRejected, match="every one of allowed_token_ids is banned") as error:
        llm.engine.add_request("banned", long, SamplingParams(min_tokens=2, allowed_token_ids=[eos]))
    assert error.value.param == "allowed_token_ids"
    _assert_idle(llm)


def test_a_preempted_constrained_answer_resumes_its_grammar(llm):
    """Three long constrained answers with two usable blocks (the chat engine's allocators swapped
    for capped ones while it is idle: the pools and programs stay as they are): they preempt each
    other past their first block, each grammar is replayed from its outputs on resumption, and
    every answer equals the one run without preemption (greedy, compared at the first near tie)
    and is in its language."""
    from conftest import capped_block_manager

    pattern = "[a-m]{60}-[n-z]{60}"
    params = [SamplingParams(temperature=0.0, max_tokens=140, logprobs=2,
                             structured_outputs={"regex": pattern}) for _ in range(3)]
    # ~110-token prompts: the answers cross into a second block of 128 positions.
    prompts = [{"prompt_token_ids": llm.get_tokenizer().encode(f"Write {i}:" + " word" * 108)} for i in range(3)]
    alone = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    scheduler = llm.engine.scheduler
    kept, preemptions = scheduler.block_managers, scheduler.num_preemptions
    scheduler.block_managers = tuple(capped_block_manager(2)(m.num_seq_slots, m.num_compressed_blocks, m.block_size,
                                                             m.max_blocks_per_seq) for m in kept)
    try:
        preempted = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert scheduler.num_preemptions > preemptions
    finally:
        scheduler.block_managers = kept
    for a, b in zip(alone, preempted):
        assert b.finish_reason == "stop" and re.fullmatch(pattern, b.text), b.text
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                ranked = sorted((lp.logprob for lp in a.logprobs[i].values()), reverse=True)
                assert ranked[0] - ranked[1] <= 1e-3, (i, a.text, b.text)
                break


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "hourly": {"type": "boolean"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object",
        "properties": {"seats": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 40},
                                 "minItems": 1, "maxItems": 3},
                       "who": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                                "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
                               "required": ["name"], "additionalProperties": False}},
        "required": ["seats", "who"]}}},
]


@pytest.mark.parametrize("choice", [None, "book"], ids=["required", "named"])
def test_required_and_named_tool_choices_give_valid_calls(llm, choice):
    """tool_choice "required" (any offered function, one or more calls) or a named function (one
    call of it), as the server maps it: the DSML grammar of `chat.tool_grammar`. Random answers at
    temperature 1 all stop, parse as calls of the offered tools, and their arguments validate
    against each function's `parameters`."""
    from dsv4_jax.chat import build_prompt, chat_message, chat_parser
    from dsv4_jax.chat.tool_grammar import tool_call_grammar

    # The tools' section is left out of the prompt (467 tokens of the 512 max_model_len): the
    # grammar, not the prompt, is what is tested.
    prompt = build_prompt([{"role": "user", "content": "Plan my trip."}], chat_template_kwargs={"thinking": False})
    grammar = tool_call_grammar(TOOLS, choice)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs={"grammar": grammar})
              for seed in range(8)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    outs = _generate(llm, params, {"prompt_token_ids": llm.get_tokenizer().encode(prompt)})
    for out in outs:
        assert out.finish_reason == "stop", out.text
        message = chat_message(out.text, chat_parser(tools_active=True, split_reasoning=False))
        calls = message["tool_calls"]
        assert calls and not message["content"], out.text
        if choice is not None:
            assert [c["function"]["name"] for c in calls] == [choice]
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_the_async_engine_serves_a_grammar_ready_when_its_request_is_added(llm, monkeypatch):
    """A matcher ready before `add_request` returns (a cached grammar on an idle worker) wakes the
    step thread from inside `add_request`, which holds the engine's lock: it must neither deadlock
    nor be lost. Here every compile is finished before its future is handed back."""
    import asyncio
    import concurrent.futures

    from dsv4_jax.engine.async_engine import AsyncLLMEngine

    def submit(self, grammar):
        future = concurrent.futures.Future()
        future.set_result(self._matcher(grammar))
        return future

    monkeypatch.setattr(so_module.GrammarCompiler, "submit", submit)
    engine = AsyncLLMEngine(llm.engine)
    ids = llm.get_tokenizer().encode("x")

    async def main():
        await engine.start()
        try:
            async def one(i):
                out = None
                async for out in engine.generate(f"ready-{i}", ids, _constrained(i, choice=["on", "off"])):
                    pass
                return out
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 60)
        finally:
            await engine.shutdown()

    for out in asyncio.run(main()):
        assert out.outputs[0].text in ("on", "off") and out.outputs[0].finish_reason == "stop"
    _assert_idle(llm)


def test_a_grammar_that_fails_computing_a_mask_ends_its_request_with_an_error(llm):
    """A regex within the validator's reach but past llguidance's lexer limits fails while its
    first tokens are consumed or its masks computed. Every request with it ends with
    finish_reason "error" and the reason, whatever min_tokens or ignore_eos say: a failed
    grammar's row allows only EOS, so no unconstrained token is ever drawn (the text holds only
    what the grammar allowed before it failed); the matcher kept for reuse does not make the next
    one pass silently. A request beside them is unharmed."""
    params = [_constrained(seed, max_tokens=8, regex="a{100000000}") for seed in range(2)]
    params += [SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, min_tokens=4,
                              structured_outputs={"regex": "a{100000000}"})]
    params += [_constrained(9, choice=["fine"])]
    outs = llm.generate([_prompt(llm)] * len(params), params, use_tqdm=False)
    for out in outs[:3]:
        completion = out.outputs[0]
        assert completion.finish_reason == "error" and "grammar failed" in out.error, (completion, out.error)
        assert re.fullmatch("a*", completion.text), completion.text  # only what the grammar allowed
    assert (outs[3].outputs[0].text, outs[3].error) == ("fine", None)
    _assert_idle(llm)


def test_schemas_that_differ_only_in_their_keys_order_keep_their_own_order(llm):
    """llguidance writes an object's properties in its schema's order: two schemas equal up to
    that order are two grammars (the compile cache keys them apart), so each answer starts with
    its own schema's first property."""
    def schema(first: str, second: str) -> dict:
        props = {first: {"type": "boolean"}, second: {"type": "boolean"}}
        return {"type": "object", "properties": props, "required": [first, second], "additionalProperties": False}

    params = [_constrained(0, json=schema("reasoning", "answer"), disable_any_whitespace=True),
              _constrained(1, json=schema("answer", "reasoning"), disable_any_whitespace=True)]
    first, second = (_generate(llm, [p])[0] for p in params)
    assert first.text.startswith('{"reasoning"') and second.text.startswith('{"answer"'), (first.text, second.text)


def test_concurrent_compiles_of_one_grammar_build_it_once(llm):
    """The `n` children of a request with a new schema reach the workers together: one builds
    the grammar, the others wait for it and copy it (each gets a matcher of its own)."""
    from dsv4_jax.engine.structured_outputs import GrammarCompiler, check_structured_outputs

    compiler = GrammarCompiler(llm.get_tokenizer().backend, llm.config.vocab_size, llm.engine.eos_token_ids)
    grammar = check_structured_outputs(StructuredOutputsParams(json=SCHEMA))
    matchers = [f.result(timeout=60) for f in [compiler.submit(grammar) for _ in range(4)]]
    assert len({id(m) for m in matchers}) == 4
    assert sorted(cached for cached, _ in compiler.compile_seconds) == [False, True, True, True]
    compiler.shutdown()
