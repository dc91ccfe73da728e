"""Tokenizers and streaming: a streamed piece never splits a UTF-8 character,
while invalid bytes show at once."""

from executorch_cellcache.runtime.tokenizer import ByteTokenizer, StreamDecoder


def _stream(tokens, tokenizer=None):
    decoder = StreamDecoder(tokenizer or ByteTokenizer())
    pieces = [decoder.push(t) for t in tokens]
    return pieces, decoder.flush()


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_id
    assert tok.decode(ids + [tok.eos_id]) == "héllo ✓"


def test_stream_waits_for_the_rest_of_a_character():
    pieces, tail = _stream(list("é✓".encode()))
    assert pieces == ["", "é", "", "", "✓"]
    assert tail == ""


def test_stream_shows_invalid_bytes_at_once_and_flushes_a_cut_character():
    pieces, tail = _stream([0xFF, 0x41, 0xC3])
    assert pieces == ["\ufffd", "A", ""]
    assert tail == "\ufffd"


def test_special_tokens_print_nothing():
    tok = ByteTokenizer()
    pieces, tail = _stream([tok.bos_id, 0x41, tok.eos_id])
    assert "".join(pieces) + tail == "A"
