"""Invoking the system C++ compiler: parallel, cached by content hash."""
