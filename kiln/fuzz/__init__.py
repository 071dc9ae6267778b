"""Differential fuzzing of kiln: random programs (`generator`, `gen_heavy`) as op lists turned
into modules (`program`), checked against eager and the Loop IR interpreter (`runner`), shrunk
when they fail (`minimise`) and written out as pytest reproducers (`report`).
The command is `kiln fuzz` (`kiln.cli.fuzz_cmd`)."""
