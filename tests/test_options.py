"""`generate` and `generate_stream` share one options value (DecodeOptions), taken whole or as keywords; and the
conversion of the caller's model to the decoding layout, done in place, is announced (LoadedTarget.layout,
stats["layout"]) and can be done at load time."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate, generate_stream
from specformer_jax.decoding.options import DecodeOptions
from specformer_jax.modeling.loaded import cpu_kernels_ready

PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120]]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


def test_options_whole_or_as_keywords(model):
    by_keywords = generate(model, PROMPTS, max_new_tokens=5, temperature=0.7, seed=3)
    options = DecodeOptions(max_new_tokens=5, temperature=0.7, seed=3)
    assert generate(model, PROMPTS, options=options).token_ids == by_keywords.token_ids
    # keywords given with options replace its fields; the options value itself is left as it was
    assert generate(model, PROMPTS, options=dataclasses.replace(options, seed=9), seed=3).token_ids == \
        by_keywords.token_ids
    events = generate_stream(model, PROMPTS, options=options)
    while True:
        try:
            next(events)
        except StopIteration as end:
            assert end.value.token_ids == by_keywords.token_ids
            break
    fields = [f.name for f in dataclasses.fields(DecodeOptions)]
    for function in (generate, generate_stream):  # help() and editors show every option
        assert list(inspect.signature(function).parameters) == ["model", "prompts", "options", *fields]


def test_an_unknown_keyword_lists_the_options(model):
    for function in (generate, generate_stream):
        with pytest.raises(TypeError) as e:
            function(model, PROMPTS, max_tokens=4)
        assert str(e.value) == (f"{function.__name__}() got an unexpected keyword argument 'max_tokens' (its options: "
                                + ", ".join(f.name for f in dataclasses.fields(DecodeOptions)) + ")")


def test_the_conversion_to_the_decoding_layout_is_announced(tiny_checkpoints):
    model = load_target(tiny_checkpoints["llama3"])
    assert model.layout == "stacked"  # as the checkpoint holds it
    packed = cpu_kernels_ready(model.cfg)
    stats = generate(model, PROMPTS, max_new_tokens=3, batch_size=2).stats
    assert stats["layout"] == model.layout == ("packed" if packed else "per-layer")  # the caller's model, converted
    stats = generate(model, PROMPTS[:1], max_new_tokens=3).stats
    assert stats["layout"] == model.layout == ("packed" if packed else "fused")  # a pool of one row
    early = load_target(tiny_checkpoints["llama3"])
    assert early.use_decoding_layout(2) is early and early.layout == ("packed" if packed else "per-layer")
    assert generate(early, PROMPTS, max_new_tokens=3, batch_size=2).token_ids == \
        generate(model, PROMPTS, max_new_tokens=3, batch_size=2).token_ids
