"""The checkpoint fuzzer behind tools/fuzz_checkpoints.py and test/convert/test_fuzz_checkpoints.py: checkpoints our
savers write (sources.py), seeded mutations of copies of them (mutations.py, hostile.py), every reader run on each
copy in a fork with limits and its outcome classified (readers.py, outcome.py), and the table of outcomes
(campaign.py). Kept out of the package: it is a test tool, and it needs nothing the package does not."""
