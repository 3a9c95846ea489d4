"""A hangup (SIGHUP) stops a long-running command as SIGTERM does.

It is what a command gets when the terminal or SSH session it runs in closes: started in the
foreground, or as a job with ``&``, it is signalled by the shell on its way out. Left to its
default, SIGHUP ended the process at once: ``serve`` cut the uploads in flight and left the fold
lease held, so that the service started again folded nothing for the lease's term (15 s);
``reindex`` and ``verify`` left their scratch store behind, ``import`` and ``seal`` the lease
(RUN-76, CLI-167). There is nothing for a hangup to reload: every setting is read at start.
"""

from __future__ import annotations

import signal

# How soon after the stopping signal another one is the same signal delivered twice: a
# terminal's hangup signals the foreground job twice, 0.2 ms apart (the shell's to its jobs and
# the kernel's as the shell exits); ``timeout`` signals the command and then its group.
REPEATED_SIGNAL_S = 1.0


def stopping_signals() -> tuple[signal.Signals, ...]:
    """The signals a long-running command stops on: SIGTERM; SIGINT unless it was ignored as the
    command started, as a shell that runs a script starts its ``&`` jobs, so that Ctrl-C on the
    script's terminal stops the script and not them; and a hangup (:func:`hangup`). ``serve``
    and ``follow`` took SIGINT even so, once their watch had opened: one in the first 2 s of a
    start was dropped, one later stopped the service (RUN-175). Asked before the command sets a
    handler of its own."""
    interrupt = () if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else (signal.SIGINT,)
    return (signal.SIGTERM, *interrupt, *hangup())


def hangup() -> tuple[signal.Signals, ...]:
    """SIGHUP, to stop on as on SIGTERM, unless it was ignored as the command started
    (``nohup``, ``setsid -f``, a ``trap '' HUP``): a command meant to outlive its terminal
    does (RUN-77). Asked before the command sets a handler of its own."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return ()
    return (signal.SIGHUP,)
