"""The run core: a rank's life (runner), the Session that assembles it, the run modes, the loop and its step,
and the loop's components that take the assembled parts."""
