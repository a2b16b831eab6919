"""How ranks find each other, and who is in the job.

- ``env``: torchrun's and SLURM's variables, the job's store, host identity, secret, timeout.
- ``store``: the client of torch's ``TCPStore`` with deadlines and errors that say which key.
- ``membership``: an elastic job's members, heartbeats and the coordinator of its rounds.
- ``generations``: one generation of an elastic job: its ranks and how a group is formed.
"""
