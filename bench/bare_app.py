"""The P2 baseline: a bare FastAPI endpoint returning a constant, served like the dispatcher."""

from fastapi import FastAPI

app = FastAPI()


@app.get("/job/{job_id}")
async def job(job_id: str) -> dict:
    return {"job_id": job_id, "status": "completed"}
