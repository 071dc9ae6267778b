"""kiln's intermediate representations: Graph IR (tensor ops), Loop IR (loop bodies and extern
calls) and Program IR (a flat list of typed lines). This package imports nothing else of kiln."""
