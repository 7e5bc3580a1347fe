"""The output contract (generations / runs Parquet schemas) and the decode configuration a decode actor needs.

Everything above imports this, nothing here imports the stages: jobs -> pipelines -> operators -> specdec_core, and
analysis reads only this contract.
"""
