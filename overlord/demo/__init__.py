"""Demo job pieces: a synthetic multi-source corpus (`overlord.demo.corpus`)."""
