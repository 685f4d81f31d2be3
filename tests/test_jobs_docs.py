"""docs/from-your-config.md's tables of the keys each trainer's reader understands are the readers' own declarations."""

from bench.jobs import keys_table


def test_the_page_s_key_tables_are_the_readers_declarations():
    text = keys_table.PAGE.read_text(encoding="utf-8")
    assert text == keys_table.regenerated(text), "run .venv/bin/python -m bench.jobs.keys_table"
    for name, keys in keys_table.reader_keys().items():
        assert f"<!-- keys: {name} -->" in text
        assert all(f"| `{key.name}` |" in text for key in keys)
