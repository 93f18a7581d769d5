"""Text in, text out: incremental detokenisation and stop strings."""
from __future__ import annotations

from conftest import generate

from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import ByteTokenizer
from protos.pdserve.v1 import generate_pb2
from router.output import IncrementalDetokenizer, OutputAssembler
from router.validation import GenerationJob

TEXT = "héllo wörld — 世界 🙂 ok"


def _job(max_new: int = 100, stops: tuple[str, ...] = (), stop_ids: tuple[int, ...] = ()):
    return GenerationJob("r", [1, 2], SamplingParams(max_new_tokens=max_new,
                                                      stop_token_ids=stop_ids), stops, True)


def test_multibyte_characters_come_out_whole():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [ord("a")])
    pieces = [detok.push(b) for b in tok.encode(TEXT)]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # A 4-byte emoji appears in one piece, when its last byte arrives.
    assert "🙂" in pieces


def test_incomplete_character_at_the_end_is_flushed_as_replacement():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(0xE4) == "" and detok.push(0xB8) == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_cuts_output_and_is_never_streamed():
    tok = ByteTokenizer()
    out = OutputAssembler(tok, _job(stops=("wörld",)))
    chunks = [out.add([b]) for b in tok.encode(TEXT)[:20]]
    assert "".join(c.text for c in chunks) == "héllo "
    assert out.finish_reason == "stop"
    assert chunks[-1].finish_reason == "stop"


def test_text_that_might_start_a_stop_string_is_held_back_then_released():
    tok = ByteTokenizer()
    out = OutputAssembler(tok, _job(stops=("abX",)))
    assert out.add(tok.encode("xa")).text == "x"
    assert out.add(tok.encode("b")).text == ""
    assert out.add(tok.encode("c")).text == "abc"


def test_stop_token_is_reported_but_not_rendered():
    tok = ByteTokenizer()
    out = OutputAssembler(tok, _job(stop_ids=(257,)))
    chunk = out.add([ord("h"), ord("i"), 257, ord("x")])
    assert chunk.token_ids == [ord("h"), ord("i"), 257]
    assert chunk.text == "hi" and chunk.finish_reason == "stop" and chunk.completion_tokens == 3


def test_length_finish_flushes_everything():
    tok = ByteTokenizer()
    out = OutputAssembler(tok, _job(max_new=3, stops=("ab",)))
    chunk = out.add(tok.encode("xya"))
    assert (chunk.text, chunk.finish_reason) == ("xya", "length")


def test_text_round_trip_and_stop_strings_through_the_cluster(cluster):
    stub = cluster.stub()
    sampling = generate_pb2.SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids, text, finish, responses = generate(stub, text=TEXT, sampling=sampling)
    assert responses[-1].usage.prompt_tokens == len(TEXT.encode())
    assert finish == generate_pb2.FINISH_REASON_LENGTH
    # Pick a stop string from the middle of what the model says, then ask again with it.
    clean = text.replace("\ufffd", "")
    stop = next(clean[i:i + 2] for i in range(len(clean) // 3, len(clean) - 1)
                if clean[i:i + 2].isprintable())
    sampling.stop.append(stop)
    ids2, text2, finish2, _ = generate(stub, text=TEXT, sampling=sampling)
    assert finish2 == generate_pb2.FINISH_REASON_STOP
    assert stop not in text2 and text.startswith(text2)
    assert text2 == text[:text.index(stop)]
    assert ids2 == ids[:len(ids2)] and len(ids2) < len(ids)


def test_non_streaming_returns_one_message_with_everything(cluster):
    sampling = generate_pb2.SamplingParams(max_new_tokens=12, ignore_eos=True)
    streamed = generate(cluster.stub(), text="one message", sampling=sampling)
    ids, text, finish, responses = generate(cluster.stub(), text="one message", sampling=sampling,
                                            stream=False)
    assert len(responses) == 1
    assert (ids, text, finish) == streamed[:3]
    assert responses[0].usage.completion_tokens == 12
