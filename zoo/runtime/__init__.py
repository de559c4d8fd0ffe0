"""The machine a command runs on, below training and explaining alike: the device and what it computes natively
(``device``), the one machine description results and runs record (``machine``), timing primitives (``timing``),
host memory kept for reuse (``memory``), the random generators as data (``random``), several processes and their
launchers (``distributed``) and the console the command-line programs share (``console``). Imports torch (and
Lightning's cluster environments when asked which launcher started a process), never the zoo's models, training
or explaining."""
