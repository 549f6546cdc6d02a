"""A user's own project as the tests bring it: a plain network file and a data-set factory module."""
