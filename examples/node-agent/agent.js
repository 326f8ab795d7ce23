// A reference agent for agent-mesh in JavaScript, on amqplib, written from docs/protocol.md
// and the JSON Schemas in schemas/ alone. It offers one capability, math.primes@1.0.0: how many
// primes are below a number (a segmented sieve that yields to the event loop between segments,
// so heartbeats keep their time while it works). Section numbers (§) point into the protocol.
//
// Environment: MESH_AMQP_URL, MESH_NAMESPACE, AGENT_ID, MESH_POOL, HEARTBEAT_INTERVAL_S,
// MESH_MANAGER_USER.
// SIGTERM drains: no new work, what runs finishes, then it deregisters and exits 0.
"use strict";

const crypto = require("node:crypto");
const amqp = require("amqplib");
const Ajv2020 = require("ajv/dist/2020");

const env = process.env;
const URL = env.MESH_AMQP_URL || "amqp://guest:guest@localhost:5672/";
const NS = env.MESH_NAMESPACE || "mesh";
const AGENT_ID = env.AGENT_ID || `primes-${crypto.randomBytes(3).toString("hex")}`;
const POOL = env.MESH_POOL || "primes";
// The managers' broker user: control messages only from it (§4.2). Unset: learned from the
// signed acceptance of our registration.
let managerUser = env.MESH_MANAGER_USER || null;
const HEARTBEAT_S = Number(env.HEARTBEAT_INTERVAL_S || "10");
const MIN_HEARTBEAT_S = 5; // §7 step 5: the least the manager accepts
const INCARNATION = crypto.randomBytes(16).toString("hex"); // §7 step 1
const MAX_CONCURRENCY = 4;
const REGISTRATION_WAIT_MS = 5000;
const DRAIN_TIMEOUT_MS = 60000;
const SHUTDOWN_GRACE_MS = 30000;
const LEASE_NOTICE_WAIT_MS = 2000;
const ANSWERS_KEPT = 4096;
const FENCE_AFTER_MS = (3 * HEARTBEAT_S - HEARTBEAT_S / 2) * 1000; // §7 step 11: 2.5 intervals
const STANDING_WAIT_MS = 5000;
const REVOCATIONS_KEPT = 10000;

// ---- the capability ------------------------------------------------------------------------
const CAPABILITY = {
  name: "math.primes",
  version: "1.0.0",
  description: "Count the primes below a number (segmented sieve).",
  input_schema: {
    $schema: "https://json-schema.org/draft/2020-12/schema",
    type: "object",
    properties: { below: { type: "integer", minimum: 2, maximum: 200000000 } },
    required: ["below"],
    additionalProperties: false,
  },
  output_schema: {
    $schema: "https://json-schema.org/draft/2020-12/schema",
    type: "object",
    properties: { below: { type: "integer" }, count: { type: "integer", minimum: 0 } },
    required: ["below", "count"],
    additionalProperties: false,
  },
  max_concurrency: MAX_CONCURRENCY,
  cost_class: "B",
};

async function countPrimes(below) {
  const limit = Math.floor(Math.sqrt(below)) + 1;
  const small = new Uint8Array(limit + 1);
  const bases = [];
  for (let i = 2; i <= limit; i++) {
    if (small[i]) continue;
    bases.push(i);
    for (let j = i * i; j <= limit; j += i) small[j] = 1;
  }
  const SEGMENT = 1 << 20;
  const marks = new Uint8Array(SEGMENT);
  let count = 0;
  for (let low = 2; low < below; low += SEGMENT) {
    const high = Math.min(low + SEGMENT, below);
    marks.fill(0);
    for (const p of bases) {
      if (p * p >= high) break;
      let start = Math.max(p * p, Math.ceil(low / p) * p);
      for (let j = start; j < high; j += p) marks[j - low] = 1;
    }
    for (let k = 0; k < high - low; k++) if (!marks[k]) count++;
    await new Promise((resolve) => setImmediate(resolve)); // let heartbeats and acks through
  }
  return { below, count };
}

const ajv = new Ajv2020({ strict: false });
const validInput = ajv.compile(CAPABILITY.input_schema);
const validOutput = ajv.compile(CAPABILITY.output_schema);

// ---- names (§2, §3) ------------------------------------------------------------------------
const X = {
  announce: `${NS}.announce`,
  heartbeat: `${NS}.heartbeat`,
  events: `${NS}.events`,
  agents: `${NS}.agents`,
  tasks: `${NS}.tasks`,
  deadLetter: `${NS}.dead-letter`,
};
const CONTROL_QUEUE = `${NS}.agent.${AGENT_ID}.control`;
const TASK_QUEUE = `${NS}.agent.${AGENT_ID}.tasks`;
const POOL_QUEUE = `${NS}.pool.${POOL}.tasks`;

// ---- state ---------------------------------------------------------------------------------
let conn, ch; // one confirming channel for everything
let seq = 0;
let heartbeatTimer = null;
let registration = null; // { resolve } while a registration waits for its answer
let registered = false;
let draining = false;
let drainComplete = null; // { promise, resolve }: settled by drain-complete (or its stand-ins)
let stopping = false;
let poolConsumer = null;
let taskConsumer = null;
let controlConsumer = null;
let activeEpoch = null; // §8.1: the pool's active epoch, null until announced
let drainingAllowlist = new Set();
const revoked = new Map(); // admission ID -> highest revoked fence (insertion order = age)
const leases = new Map(); // lease ID -> ms timestamp it ends (lease notices, §4.2)
const answered = new Map(); // answer key -> result (§7 step 9)
const inFlight = { count: 0, pool: 0 };
let lastBeatAt = null; // the last heartbeat we sent (monotonic ms); none before acceptance
let fencedBefore = -Infinity; // tasks claimed at or before this (monotonic ms) are suspect
let forgottenAt = -Infinity; // the manager last asked us to register again
let standingWaiter = null; // resolves with the manager's mesh.standing.v1
let shard = null; // several managers: our shard, told in the acceptance (feature "shards")

// A routing key to our shard's owner: with several managers, the shard is its last word.
function sharded(key) {
  return shard === null ? key : `${key}.${shard}`;
}
let slotsFree = MAX_CONCURRENCY;
const slotWaiters = [];

function log(msg, extra = {}) {
  console.error(JSON.stringify({ ts: Date.now() / 1000, agent_id: AGENT_ID, msg, ...extra }));
}

function body(message) {
  return Buffer.from(JSON.stringify(message));
}

// A confirmed, mandatory publish (§1.5).
function publish(exchange, key, message, options = {}) {
  return new Promise((resolve, reject) => {
    ch.publish(
      exchange,
      key,
      Buffer.isBuffer(message) ? message : body(message),
      {
        contentType: "application/json",
        mandatory: true,
        messageId: crypto.randomBytes(16).toString("hex"),
        type: message.type,
        ...options,
      },
      (err) => (err ? reject(err) : resolve()),
    );
  });
}

// ---- heartbeats (§7 step 5) and silences (§7 step 11) --------------------------------------
function noteSilence(now) {
  // Before the first heartbeat nothing was claimed, and a wait for acceptance (a deferred
  // registration: AGENT_ID_IN_USE) is no silence the manager could have declared us lost in.
  if (lastBeatAt === null) return;
  if (now - lastBeatAt > FENCE_AFTER_MS && fencedBefore < lastBeatAt) {
    fencedBefore = now;
    log("silent long enough to be declared lost: results of earlier tasks wait for the manager");
  }
}

// Is this incarnation's registration older than the claim (we were not declared lost since)?
async function stillRegistered(claimedAt) {
  if (forgottenAt >= claimedAt) return false;
  const giveUp = performance.now() + 3 * STANDING_WAIT_MS;
  while (performance.now() < giveUp) {
    const asked = performance.now();
    const answer = new Promise((resolve) => (standingWaiter = resolve));
    try {
      const request = { type: "mesh.standing-request.v1", agent_id: AGENT_ID, incarnation: INCARNATION };
      await publish(X.announce, sharded(`agent.${AGENT_ID}.standing`), request);
    } catch (err) {
      await sleep(200);
      continue;
    }
    const standing = await Promise.race([answer, sleep(STANDING_WAIT_MS).then(() => null)]);
    standingWaiter = null;
    if (standing === null) continue;
    if (!standing.registered || standing.registered_for_s == null) {
      leases.clear(); // declared lost: the leases of that registration went with it
      return false;
    }
    return asked - standing.registered_for_s * 1000 <= claimedAt && forgottenAt < claimedAt;
  }
  return false;
}

function heartbeat() {
  const now = performance.now();
  noteSilence(now);
  lastBeatAt = now;
  const message = {
    type: "mesh.heartbeat.v1",
    agent_id: AGENT_ID,
    incarnation: INCARNATION,
    seq: seq++,
    in_flight: { [CAPABILITY.name]: inFlight.count },
    pool_in_flight: inFlight.pool > 0 ? { [CAPABILITY.name]: inFlight.pool } : {},
    draining,
    sent_at: Date.now() / 1000,
  };
  // Heartbeats: not confirmed, not mandatory, transient (§4.1).
  ch.publish(X.heartbeat, sharded(`hb.${AGENT_ID}`), body(message), { contentType: "application/json" });
}

function startHeartbeats() {
  heartbeat();
  heartbeatTimer = setInterval(heartbeat, HEARTBEAT_S * 1000);
}

function stopHeartbeats() {
  if (heartbeatTimer) clearInterval(heartbeatTimer);
  heartbeatTimer = null;
}

// ---- registration (§7 step 3) --------------------------------------------------------------
function registrationMessage() {
  return {
    type: "mesh.agent-registration.v1",
    agent_id: AGENT_ID,
    incarnation: INCARNATION,
    deployment: POOL,
    capabilities: [CAPABILITY],
    heartbeat_interval_s: HEARTBEAT_S,
    features: ["descriptor-epochs", "lease-notices", "pool-epoch", "shards", "hand-over"],
    metadata: { language: "javascript", client: "amqplib" },
  };
}

async function register() {
  for (let attempt = 0; ; attempt++) {
    const answer = new Promise((resolve) => (registration = { resolve }));
    try {
      await publish(X.announce, `agent.${AGENT_ID}.register`, registrationMessage(), {
        persistent: true,
      });
    } catch (err) {
      log("registration not confirmed", { error: String(err) });
    }
    const reply = await Promise.race([answer, sleep(REGISTRATION_WAIT_MS).then(() => null)]);
    registration = null;
    if (reply === null) {
      const step = Math.min(10, 0.5 * 2 ** attempt);
      await sleep((step / 2 + Math.random() * (step / 2)) * 1000);
      continue;
    }
    if (reply.type === "mesh.registration-accepted.v1") {
      if (reply.pool_epoch) applyEpoch(reply.pool_epoch);
      shard = reply.shard ?? null; // several managers: the last word of our keys from now on
      registered = true;
      log("registration accepted");
      return;
    }
    if (reply.retry_after_ms == null) {
      throw new Error(`registration refused: ${reply.reason}: ${reply.detail}`);
    }
    log("registration deferred", { reason: reply.reason, retry_after_ms: reply.retry_after_ms });
    await sleep(reply.retry_after_ms * (1 + 0.1 * Math.random()));
  }
}

// ---- the control queue (§4.2, §4.3) --------------------------------------------------------
function onControl(msg) {
  let message;
  try {
    message = JSON.parse(msg.content.toString("utf8"));
  } catch (err) {
    deadLetter(msg, CONTROL_QUEUE, "MALFORMED_JSON", String(err));
    return;
  }
  const sender = msg.properties.userId || null;
  if (managerUser === null) {
    // The first signed acceptance of the registration we are waiting for names the managers'
    // user (nobody else knows our incarnation yet).
    if (
      sender &&
      message.type === "mesh.registration-accepted.v1" &&
      message.incarnation === INCARNATION &&
      registration
    ) {
      managerUser = sender;
    }
  } else if (sender !== managerUser) {
    if (message.type === "mesh.reregister-request.v1" && sender === null) {
      // Unsigned (an older manager): registering again cannot hurt; dropping leases could.
      message = { ...message, leases_kept: true };
    } else {
      deadLetter(msg, CONTROL_QUEUE, "NOT_AUTHORIZED", `${message.type} not from the managers' user`);
      return;
    }
  }
  try {
    handleControl(message);
  } finally {
    ch.ack(msg);
  }
}

function handleControl(m) {
  switch (m.type) {
    case "mesh.registration-accepted.v1":
    case "mesh.registration-refused.v1":
      if (m.incarnation === INCARNATION && registration) registration.resolve(m);
      return;
    case "mesh.standing.v1":
      if (m.incarnation === INCARNATION && standingWaiter) standingWaiter(m);
      return;
    case "mesh.reregister-request.v1":
      if (m.leases_kept) {
        // Our shard moved to another manager: the leases we were told of stay valid (a
        // task under one may be on its way). Mid-drain the drain is not over: the new
        // owner, not knowing us, says so at our next heartbeat.
        if (draining || !registered || registration) return;
        log("registering with our shard's new manager", {});
        register().catch((err) => fail(err));
        return;
      }
      forgottenAt = performance.now();
      leases.clear(); // the manager forgot that registration, and the leases it told us of
      if (draining) {
        drainComplete.resolve(); // the manager holds nothing for us
      } else if (registered && !registration) {
        log("manager asked us to register again", { reason: m.reason });
        register().catch((err) => fail(err));
      }
      return;
    case "mesh.drain-notice.v1":
      startDrain(m.reason || "drain notice", false);
      return;
    case "mesh.drain-complete.v1":
      startDrain("drain complete", false);
      drainComplete.resolve();
      return;
    case "mesh.lease-notice.v1":
      if (m.ended) leases.delete(m.lease_id);
      else leases.set(m.lease_id, Date.now() + m.expires_in_s * 1000);
      return;
    case "mesh.orchestration-event.v1":
      onEvent(m);
      return;
    case "mesh.refusal.v1": // an answer to our own drain request: nothing is held for us
      if (draining && ["UNKNOWN_AGENT", "AGENT_TERMINATED"].includes(m.reason)) {
        drainComplete.resolve();
      }
      return;
    default: // drain-accepted, standing, admission-state: nothing to do here
      return;
  }
}

function applyEpoch(detail) {
  if (detail.pool_id !== POOL || !Number.isInteger(detail.descriptor_epoch)) return;
  const epoch = detail.descriptor_epoch;
  if (activeEpoch !== null && epoch < activeEpoch) return; // epochs only grow
  const newer = activeEpoch === null || epoch > activeEpoch;
  activeEpoch = epoch;
  if (Array.isArray(detail.draining)) drainingAllowlist = new Set(detail.draining);
  if (newer && registered && !poolConsumer && !draining) consumePool().catch(() => {});
}

function onEvent(event) {
  const d = event.detail || {};
  if (event.kind === "descriptor_active") {
    applyEpoch(d);
  } else if (event.kind === "grant_revoked" && d.pool_id === POOL && Number.isInteger(d.fence)) {
    const seen = revoked.get(d.admission_id) || 0;
    revoked.delete(d.admission_id); // re-inserted: the newest
    revoked.set(d.admission_id, Math.max(seen, d.fence));
    if (revoked.size > REVOCATIONS_KEPT) revoked.delete(revoked.keys().next().value);
  }
}

// ---- grant checks (§8.1) -------------------------------------------------------------------
function grantProblem(grant) {
  if (grant.pool_id !== POOL) return `grant for pool ${grant.pool_id}, this agent is in ${POOL}`;
  if (Date.now() / 1000 >= grant.expires_at) return "the grant expired";
  const fence = revoked.get(grant.admission_id);
  if (fence !== undefined && fence >= grant.fence) return `revoked at fence ${fence}`;
  if (
    activeEpoch !== null &&
    grant.descriptor_epoch < activeEpoch &&
    !drainingAllowlist.has(grant.admission_id)
  ) {
    return `grant of epoch ${grant.descriptor_epoch}, the active epoch is ${activeEpoch}`;
  }
  return null;
}

async function leaseKnown(leaseId) {
  const deadline = Date.now() + LEASE_NOTICE_WAIT_MS; // a notice may be a moment late
  for (;;) {
    const until = leases.get(leaseId);
    if (until !== undefined && until > Date.now()) return true;
    if (Date.now() >= deadline) return false;
    await sleep(50);
  }
}

// ---- tasks (§7 steps 6-13) -----------------------------------------------------------------
function result(task, startedAt, fields) {
  return {
    type: "mesh.task-result.v1",
    task_id: task.task_id,
    agent_id: AGENT_ID,
    capability: task.capability,
    started_at: startedAt,
    finished_at: Date.now() / 1000,
    degradations: [],
    ...fields,
  };
}

function failure(task, startedAt, code, message) {
  return result(task, startedAt, { status: "error", error: { code, message: message.slice(0, 4000) } });
}

// The task's W3C trace context (docs/protocol.md, "Trace context"), carried on unchanged onto
// its result so the producer's trace does not break at this agent. An agent with a tracer of
// its own would put its span's context here instead.
function traceContext(msg) {
  const headers = msg.properties.headers || {};
  const carried = {};
  for (const name of ["traceparent", "tracestate"]) {
    if (typeof headers[name] === "string" || Buffer.isBuffer(headers[name])) {
      carried[name] = String(headers[name]);
    }
  }
  return carried;
}

// Publish the result to the task's reply_to, then ack the task (``ack`` false: the caller
// settles it, e.g. by dead-lettering it).
async function answer(msg, result, ack = true) {
  const replyTo = msg.properties.replyTo;
  if (replyTo) {
    try {
      await publish("", replyTo, result, {
        correlationId: result.task_id,
        headers: { "x-mesh-agent-id": AGENT_ID, ...traceContext(msg) },
      });
    } catch (err) {
      log("result not confirmed; the task goes back", { task_id: result.task_id });
      ch.nack(msg, false, true);
      return false;
    }
  }
  if (ack) ch.ack(msg);
  return true;
}

async function deadLetter(msg, queue, reason, detail) {
  const content = msg.content.subarray(0, 4096);
  try {
    await publish(X.deadLetter, queue, content, {
      persistent: true,
      correlationId: msg.properties.correlationId,
      headers: {
        ...(msg.properties.headers || {}),
        "x-mesh-reason": reason,
        "x-mesh-detail": String(detail).slice(0, 1000),
        "x-mesh-source-queue": queue,
        "x-mesh-original-size": msg.content.length,
        "x-mesh-truncated": msg.content.length > 4096,
        "x-mesh-original-routing-key": msg.fields.routingKey,
        "x-mesh-original-exchange": msg.fields.exchange,
      },
    });
    ch.ack(msg);
  } catch (err) {
    ch.nack(msg, false, false); // the queue's own dead-letter exchange takes it
  }
}

async function takeSlot(fromPool) {
  while (slotsFree === 0) {
    if (fromPool && draining) return false;
    await new Promise((resolve) => slotWaiters.push(resolve));
  }
  if (fromPool && draining) return false;
  slotsFree--;
  return true;
}

function giveSlot() {
  slotsFree++;
  const next = slotWaiters.shift();
  if (next) next();
}

async function onTask(msg, fromPool) {
  const queue = fromPool ? POOL_QUEUE : TASK_QUEUE;
  let task;
  try {
    task = JSON.parse(msg.content.toString("utf8"));
    if (task.type !== "mesh.task.v1" || typeof task.task_id !== "string") throw new Error("not a task");
  } catch (err) {
    await deadLetter(msg, queue, "SCHEMA_VIOLATION", String(err));
    return;
  }
  const startedAt = Date.now() / 1000;
  // Credentials (§7 step 7): a grant, or a lease we were told of.
  if (task.grant) {
    const problem = grantProblem(task.grant);
    if (problem) {
      await answer(msg, failure(task, startedAt, "GRANT_INVALID", `at claim: ${problem}`));
      return;
    }
  } else if (fromPool || !task.lease_id || !(await leaseKnown(task.lease_id))) {
    // No credentials at all: NOT_AUTHORIZED. A lease this incarnation was not told of, or
    // that ended: UNKNOWN_LEASE, which a producer answers by leasing again (§7 step 7).
    const unknownLease = !fromPool && Boolean(task.lease_id);
    const code = unknownLease ? "UNKNOWN_LEASE" : "NOT_AUTHORIZED";
    const why = fromPool
      ? "a pool task without a grant"
      : unknownLease
        ? "no lease this incarnation was told of"
        : "the task carries neither a grant nor a lease";
    if (await answer(msg, failure(task, startedAt, code, why), false)) {
      await deadLetter(msg, queue, code, why); // and acked there
    }
    return;
  }
  const key = task.grant ? `admission:${task.grant.admission_id}/${task.task_id}` : `task:${task.task_id}`;
  const earlier = answered.get(key);
  if (earlier) {
    await answer(msg, earlier); // done here before: the same answer (§7 step 9)
    return;
  }
  if (!(await takeSlot(fromPool))) {
    ch.nack(msg, false, true); // draining: a pool task not started goes back
    return;
  }
  inFlight.count++;
  if (fromPool) inFlight.pool++;
  const claimedAt = performance.now();
  try {
    const done = await run(task, startedAt);
    noteSilence(performance.now());
    if (claimedAt <= fencedBefore && !(await stillRegistered(claimedAt))) {
      log("result withheld: claimed before a silence we were declared lost in", { task_id: task.task_id });
      ch.nack(msg, false, true); // its work has moved on; back to the queue
      return;
    }
    const late = task.grant ? grantProblem(task.grant) : null;
    const final = late ? failure(task, startedAt, "GRANT_INVALID", `before the result: ${late}`) : done;
    if (await answer(msg, final)) {
      answered.set(key, final);
      if (answered.size > ANSWERS_KEPT) answered.delete(answered.keys().next().value);
    }
  } finally {
    inFlight.count--;
    if (fromPool) inFlight.pool--;
    giveSlot();
  }
}

async function run(task, startedAt) {
  if (task.capability !== CAPABILITY.name) {
    return failure(task, startedAt, "CAPABILITY_NOT_HANDLED", `no capability ${task.capability}`);
  }
  if (task.deadline != null && Date.now() / 1000 > task.deadline) {
    return failure(task, startedAt, "DEADLINE_EXCEEDED", "the deadline passed before it ran");
  }
  if (!validInput(task.payload)) {
    return failure(task, startedAt, "INPUT_SCHEMA_VIOLATION", ajv.errorsText(validInput.errors));
  }
  let output;
  try {
    output = await countPrimes(task.payload.below);
  } catch (err) {
    return failure(task, startedAt, "HANDLER_ERROR", String(err));
  }
  if (task.deadline != null && Date.now() / 1000 > task.deadline) {
    return failure(task, startedAt, "DEADLINE_EXCEEDED", "finished after the deadline");
  }
  if (!validOutput(output)) {
    return failure(task, startedAt, "OUTPUT_SCHEMA_VIOLATION", ajv.errorsText(validOutput.errors));
  }
  return result(task, startedAt, { status: "ok", output });
}

async function consumePool() {
  // A passive declare of a queue that does not exist closes its channel: probe on a channel
  // of its own. No pool queue yet (no descriptor): the next descriptor_active brings it (§9).
  const probe = await conn.createChannel();
  probe.on("error", () => {});
  try {
    await probe.checkQueue(POOL_QUEUE);
  } catch (err) {
    log("no pool queue yet; waiting for the pool's descriptor", { queue: POOL_QUEUE });
    return;
  } finally {
    probe.close().catch(() => {});
  }
  if (poolConsumer || draining) return;
  await ch.prefetch(MAX_CONCURRENCY);
  let tag = null;
  ({ consumerTag: tag } = await ch.consume(POOL_QUEUE, (msg) => {
    if (msg) onTask(msg, true);
    else poolQueueGone(tag);
  }));
  poolConsumer = tag;
}

// amqplib hands the consumer `null` when the broker cancels it: the pool queue was deleted.
// Not subscribed any more; look for the queue again (the manager declares it again) at
// 0.5 s, then at doubling intervals up to 5 s, until it is back (§9).
function poolQueueGone(tag) {
  if (poolConsumer !== tag) return;
  poolConsumer = null;
  log("our pool queue was deleted; subscribing again once it is back", { queue: POOL_QUEUE });
  let delay = 500;
  const retry = async () => {
    if (poolConsumer || draining || stopping) return;
    await consumePool().catch(() => {});
    if (poolConsumer || draining || stopping) return;
    delay = Math.min(2 * delay, 5000);
    setTimeout(retry, delay);
  };
  setTimeout(retry, delay);
}

// ---- drain and exit (§7 steps 14-15) -------------------------------------------------------
function beginDrain(reason) {
  if (draining) return;
  draining = true;
  log("draining", { reason });
  if (poolConsumer) {
    const tag = poolConsumer;
    poolConsumer = null;
    ch.cancel(tag).catch(() => {});
  }
  for (const wake of slotWaiters.splice(0)) wake(); // waiting pool tasks go back
  heartbeat(); // says draining, and what still runs
}

// The drain, once: ``ask`` when it is our own decision (SIGTERM), so the manager is told.
function startDrain(reason, ask) {
  if (stopping) return;
  stopping = true;
  drainComplete = {};
  drainComplete.promise = new Promise((resolve) => (drainComplete.resolve = resolve));
  finish(reason, ask).catch(fail);
}

async function finish(reason, ask) {
  if (ask) {
    try {
      const request = { type: "mesh.drain-request.v1", agent_id: AGENT_ID, incarnation: INCARNATION, reason };
      await publish(X.announce, sharded(`agent.${AGENT_ID}.drain`), request, {
        persistent: true,
        replyTo: CONTROL_QUEUE,
        correlationId: INCARNATION,
      });
    } catch (err) {
      log("drain request not confirmed; draining anyway", { error: String(err) });
    }
  }
  beginDrain(reason);
  await Promise.race([drainComplete.promise, sleep(DRAIN_TIMEOUT_MS)]);
  stopHeartbeats();
  const graceEnds = Date.now() + SHUTDOWN_GRACE_MS;
  while (inFlight.count > 0 && Date.now() < graceEnds) await sleep(50);
  if (taskConsumer) await ch.cancel(taskConsumer).catch(() => {});
  try {
    await publish(X.announce, sharded(`agent.${AGENT_ID}.deregister`), {
      type: "mesh.agent-deregistration.v1",
      agent_id: AGENT_ID,
      incarnation: INCARNATION,
      reason: reason.slice(0, 500),
    }, { persistent: true });
  } catch (err) {
    log("deregistration not confirmed", { error: String(err) });
  }
  if (controlConsumer) await ch.cancel(controlConsumer).catch(() => {});
  // A quorum queue refuses an if-empty delete (and the broker closes the connection for it):
  // count, then delete. Drained, nothing is leased on us any more.
  const left = await ch.checkQueue(TASK_QUEUE).catch(() => null);
  if (left && left.messageCount === 0) await ch.deleteQueue(TASK_QUEUE).catch(() => {});
  await conn.close().catch(() => {});
  log("stopped");
  process.exit(0);
}

function fail(err) {
  log("stopping on an error", { error: String(err && err.stack ? err.stack : err) });
  process.exit(1);
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// ---- start (§7 steps 1-4) ------------------------------------------------------------------
async function main() {
  if (!(HEARTBEAT_S >= MIN_HEARTBEAT_S)) {
    throw new Error(`HEARTBEAT_INTERVAL_S=${env.HEARTBEAT_INTERVAL_S} is below ${MIN_HEARTBEAT_S} s`);
  }
  conn = await amqp.connect(URL, {
    // Named and tagged as the SDK's (§1): a fence of a lost incarnation spares this one.
    clientProperties: { connection_name: `agent:${AGENT_ID}`, mesh_incarnation: INCARNATION },
  });
  conn.on("error", (err) => fail(err));
  conn.on("close", () => stopping || fail(new Error("the broker closed the connection")));
  ch = await conn.createConfirmChannel();
  ch.on("return", (msg) => log("returned: nobody is bound", { key: msg.fields.routingKey }));
  for (const name of Object.values(X)) await ch.checkExchange(name); // the manager declares them
  await ch.assertQueue(CONTROL_QUEUE, {
    durable: false,
    exclusive: false,
    autoDelete: true,
    arguments: { "x-queue-type": "classic", "x-max-length": 1000, "x-overflow": "reject-publish" },
  });
  await ch.bindQueue(CONTROL_QUEUE, X.agents, AGENT_ID);
  await ch.bindQueue(CONTROL_QUEUE, X.events, `grant.${POOL}.#`);
  await ch.assertQueue(TASK_QUEUE, {
    durable: true,
    exclusive: false,
    autoDelete: false,
    arguments: {
      "x-queue-type": "quorum", // leased tasks wait here: a broker node's loss must not lose them
      "x-max-length": 2 * MAX_CONCURRENCY,
      "x-overflow": "reject-publish",
      "x-expires": 1800000,
      "x-dead-letter-exchange": X.deadLetter,
    },
  });
  await ch.bindQueue(TASK_QUEUE, X.tasks, AGENT_ID);
  await ch.prefetch(16); // per consumer, for the consumers that follow
  controlConsumer = (await ch.consume(CONTROL_QUEUE, (msg) => msg && onControl(msg))).consumerTag;

  process.on("SIGTERM", () => startDrain("SIGTERM", true));
  process.on("SIGINT", () => startDrain("SIGINT", true));
  await register();
  startHeartbeats();
  if (stopping) return; // drained while registering
  await ch.prefetch(MAX_CONCURRENCY);
  taskConsumer = (await ch.consume(TASK_QUEUE, (msg) => msg && onTask(msg, false))).consumerTag;
  await consumePool();
  log("ready", { pool: POOL, capability: `${CAPABILITY.name}@${CAPABILITY.version}` });
}

main().catch(fail);
