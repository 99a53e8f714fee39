"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and exact verification.

A decoding request's proposed tokens run through the target model in the same step as its last
token (a row of ``1 + k`` tokens, as a prefill chunk runs), the runner keeps the logits of all
``1 + k`` positions, and `rejection.verify` accepts a prefix of the drafts plus one token of its
own, so a request's outputs keep the target's distribution (greedy: exactly its tokens). Greedy rows
without per-position host work are verified on the device instead (`rejection.verify_greedy_rows`).
"""
