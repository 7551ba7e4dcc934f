"""One-off experiments kept as the record behind benchmark/NOTES.md."""
