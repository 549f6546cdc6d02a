"""Model files in the user's style, loaded by ``MODELFILE=models.<file>`` and ``MODELCLASS=<class>``."""
