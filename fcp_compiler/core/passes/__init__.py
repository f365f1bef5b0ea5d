"""Compiler passes: each a pure function from one frozen IR object to the next."""
