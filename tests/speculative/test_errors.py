"""The one-line error helper (speculative/errors.py)."""

from draftsmith.speculative.errors import first_line


def test_first_line_quotes_the_first_line_stripped():
    assert first_line(ValueError("\n  bad value  \nat line 3\n")) == "bad value"


def test_first_line_of_an_empty_message_is_the_type_name():
    assert first_line(KeyError()) == "KeyError"
    assert first_line(OSError("  \n ")) == "OSError"
