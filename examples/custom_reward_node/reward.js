// A rollstream reward service in Node.js, written from docs/custom-reward.md and
// proto/rollstream/v1/rollout.proto only: npm `redis` (node-redis) and `protobufjs`, nothing
// of rollstream's.
//
// It reads RolloutGroups from rs:{<run>}:rollouts in a consumer group, refuses (dead-letters)
// a group whose task is not in the trainer's task map rs:{<run>}:tasks, gives every
// completion a reward, and writes the group to rs:{<run>}:ready (or :scored when the run has
// a reference stage), acknowledging the input in the same Lua script. What it does, in the
// order of docs/custom-reward.md:
//   - its own pending entries first (a restart under the same --consumer resumes them);
//   - then entries another consumer left pending longer than --claim-idle-ms (XPENDING IDLE +
//     XCLAIM, never its own: not XAUTOCLAIM), then new ones (XREADGROUP >);
//   - an entry delivered more than --max-deliveries times, or one that is not a
//     RolloutGroup of schema 1, goes to rs:{<run>}:dead with the reason;
//   - the output is the input's bytes with the rewards spliced in (every other field,
//     unknown ones and 64-bit integers included, travels byte for byte);
//   - trims what every consumer group has acknowledged; waits out Redis with back-off;
//     stops cleanly on SIGTERM / SIGINT after the entry in hand.
//
// The grader is deliberately trivial and checkable: reward = (number of completion tokens
// mod 3) / 2, so 0, 0.5 or 1. Replace score() with yours.
//
//   npm ci
//   node reward.js --from-up runs/demo/external-reward.json      # next to `rollstream up --external-reward`
//   node reward.js --redis-url redis://127.0.0.1:6379/0 --run demo --output-stage ready
import { existsSync, readFileSync } from "node:fs";
import { hostname } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import protobuf from "protobufjs";
import { createClient, RESP_TYPES } from "redis";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const SCHEMA = "1"; // the `schema` field this code reads and writes
const GROUP_TYPE = "rollstream.v1.RolloutGroup";
const DEAD_TYPE = "rollstream.v1.DeadLetter";
const DEAD_MAXLEN = "100000"; // the dead-letter stream is capped (approximately), as the built-in stages do

// The commit script of docs/custom-reward.md, used for outputs and dead letters alike.
// KEYS: input stream, output stream, our counters (rs:{<run>}:stats:reward: the only hash the
// reward user may write).
// ARGV: group, consumer, entry id, stats field, output MAXLEN ("0": none), then the output
// entry's field/value pairs. Writes only while the entry is still pending on this consumer:
// a commit retried after a lost reply, or one that lost its entry to a take-over, writes
// nothing (returns 0). Every key and the counter are checked before anything is written: what
// a key holds (another type, a counter that is not an integer) refuses the commit whole
// ("... nothing written"); the loop says so and retries. Then the output, the ack, the counter.
const COMMIT = `
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then
  return 0
end
-- Check before writing (Redis has no rollback): a key of another type, or a counter that
-- is not an integer, refuses the commit whole, the entry still pending.
local want = {'stream', 'stream', 'hash'}
for k = 1, 3 do
  local have = redis.call('TYPE', KEYS[k])['ok']
  if have ~= 'none' and have ~= want[k] then
    return redis.error_reply('WRONGTYPE ' .. KEYS[k] .. ' is a ' .. have .. ': nothing written')
  end
end
local count = redis.call('HGET', KEYS[3], ARGV[4])
local digits = count and string.match(count, '^%-?([1-9]%d*)$')
if count and count ~= '0' and not (digits and #digits <= 18) then
  return redis.error_reply('NOTCOUNTER ' .. ARGV[4] .. ' of ' .. KEYS[3] .. ' is not an integer: nothing written')
end
if ARGV[5] == '0' then
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 6))
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 6))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
`;

const AUTH_ERROR = /NOPERM|WRONGPASS|NOAUTH|invalid username-password/i;

class BadEntry extends Error {} // not usable as it is: dead-letter it with this message
class Misconfigured extends Error {} // wrong password, a command the ACL refuses: exit 2

/** (reward, component) for one completion. Yours goes here. */
export function score(completion) {
  const reward = (completion.tokenIds.length % 3) / 2;
  return { reward, components: [{ name: "length_mod3", value: reward, weight: 1, status: "ok" }] };
}

function log(event, fields = {}) {
  process.stderr.write(JSON.stringify({ ts: new Date().toISOString(), event, ...fields }) + "\n");
}

// ---- protobuf: read with protobufjs, write by splicing the original bytes ----------------

/**
 * The group's bytes with every completion's reward (field 6) and reward_components
 * (field 7) replaced and scored (field 10) = true; every other field is copied byte for
 * byte. Re-encoding with protobufjs would drop fields this code's .proto does not know
 * (protobufjs keeps no unknown fields) and would need 64-bit integers handled; splicing
 * keeps both exactly as the generator wrote them.
 */
export function spliceScores(data, scores, RewardComponent) {
  const chunks = [];
  const r = protobuf.Reader.create(data);
  let i = 0;
  while (r.pos < r.len) {
    const start = r.pos;
    const tag = r.uint32();
    const field = tag >>> 3;
    const wireType = tag & 7;
    if (field === 5 && wireType === 2) {
      const completion = r.bytes();
      chunks.push(protobuf.Writer.create().uint32(tag).bytes(spliceCompletion(completion, scores[i++], RewardComponent)).finish());
      continue;
    }
    r.skipType(wireType);
    if (field === 10) continue; // scored: written once, below
    chunks.push(data.subarray(start, r.pos));
  }
  if (i !== scores.length) throw new Error(`spliced ${i} completions for ${scores.length} scores`);
  chunks.push(protobuf.Writer.create().uint32((10 << 3) | 0).bool(true).finish());
  return Buffer.concat(chunks);
}

function spliceCompletion(data, scored, RewardComponent) {
  const chunks = [];
  const r = protobuf.Reader.create(data);
  while (r.pos < r.len) {
    const start = r.pos;
    const tag = r.uint32();
    r.skipType(tag & 7);
    const field = tag >>> 3;
    if (field === 6 || field === 7) continue; // reward, reward_components: ours to write
    chunks.push(data.subarray(start, r.pos));
  }
  const w = protobuf.Writer.create().uint32((6 << 3) | 5).float(scored.reward);
  for (const c of scored.components) w.uint32((7 << 3) | 2).bytes(RewardComponent.encode(RewardComponent.create(c)).finish());
  chunks.push(w.finish());
  return Buffer.concat(chunks);
}

// ---- stream ids -----------------------------------------------------------------------

function parseId(id) {
  const [ms, seq = "0"] = String(id).split("-");
  return [BigInt(ms), BigInt(seq)];
}

function compareIds(a, b) {
  return a[0] !== b[0] ? (a[0] < b[0] ? -1 : 1) : a[1] === b[1] ? 0 : a[1] < b[1] ? -1 : 1;
}

// ---- the service ----------------------------------------------------------------------

class RewardService {
  constructor(opts, types) {
    this.opts = opts;
    this.types = types;
    const prefix = `rs:{${opts.run}}:`; // the {run} hash tag: one Redis Cluster slot per run
    this.source = prefix + "rollouts";
    this.output = prefix + opts.outputStage;
    this.dead = prefix + "dead";
    this.stats = prefix + "stats:reward";
    this.tasks = prefix + "tasks"; // task_id -> PromptTask, written by the trainer only
    this.stopping = false;
    this.wake = null; // ends a back-off sleep early on SIGTERM
    this.ownCursor = "0";
    this.ownDone = false;
    this.rereadQuietly = false;
    this.commitSha = null;
  }

  async connect() {
    const o = this.opts;
    const client = createClient({
      url: o.redisUrl,
      username: o.redisUsername || undefined,
      password: o.redisPassword || undefined,
      // node-redis v6 sends CLIENT SETINFO and CLIENT MAINT_NOTIFICATIONS at connect; the
      // `reward` ACL user has no CLIENT: refused (harmless, but each fills the server's ACL LOG).
      disableClientInfo: true,
      maintNotifications: "disabled",
      socket: {
        // Redis away or restarting: retry with back-off, forever. A refused password or user is
        // a configuration error, not an outage: give up (exit 2).
        reconnectStrategy: (retries, cause) => (AUTH_ERROR.test(String(cause && cause.message)) ? new Misconfigured(String(cause.message)) : Math.min(100 * 2 ** retries, 5000)),
        connectTimeout: 10000,
      },
    });
    client.on("error", () => {}); // reconnects are node-redis's job; the loop logs the outage once
    // node-redis v6 speaks RESP3 and decodes strings as UTF-8 text: `data` is binary, so every
    // bulk string comes back as a Buffer.
    this.raw = client;
    this.r = client.withTypeMapping({ [RESP_TYPES.BLOB_STRING]: Buffer });
    await client.connect();
    if (this.stopping) return;
    await this.ensureGroup();
  }

  async ensureGroup() {
    try {
      await this.r.xGroupCreate(this.source, this.opts.group, "0", { MKSTREAM: true });
    } catch (e) {
      if (!String(e.message).includes("BUSYGROUP")) throw e;
    }
  }

  async run() {
    const o = this.opts;
    let nextTrim = 0;
    let outage = null;
    let backoff = 200;
    log("started", { source: this.source, output: this.output, group: o.group, consumer: o.consumer, max_deliveries: o.maxDeliveries, claim_idle_ms: o.claimIdleMs });
    while (!this.stopping) {
      try {
        const entries = await this.read();
        // A slow scorer, for the demo and the tests: the batch stays pending on us meanwhile.
        if (entries.length && o.holdMs > 0) await this.sleep(o.holdMs);
        for (const e of entries) {
          await this.handle(e);
        }
        if (Date.now() >= nextTrim) {
          await this.trim();
          nextTrim = Date.now() + o.trimEveryMs;
        }
        if (outage) {
          log("redis_recovered", { after_s: (Date.now() - outage) / 1000 });
          outage = null;
          backoff = 200;
        }
      } catch (e) {
        const text = String(e && e.message);
        if (AUTH_ERROR.test(text)) throw new Misconfigured(text);
        // Whatever we hold is still pending on us: read it again first, without counting a delivery.
        this.ownCursor = "0";
        this.ownDone = false;
        this.rereadQuietly = true;
        if (text.includes("NOGROUP")) {
          await this.ensureGroup().catch(() => {}); // the stream or group was deleted (a fresh run): join again
        } else if (text.includes("nothing written")) {
          log("commit_refused", { error: text }); // a key to fix: said each time, retried
        } else if (!outage) {
          outage = Date.now();
          log("redis_unavailable", { error: text });
        }
        await this.sleep(backoff);
        backoff = Math.min(backoff * 2, 5000);
      }
    }
  }

  // -- reading: own pending, then take-over, then new (docs/custom-reward.md, "Reading") --

  async read() {
    const count = this.opts.count;
    let entries = [];
    if (!this.ownDone) entries = await this.readOwnPending(count);
    if (!entries.length) entries = await this.claimStale(count);
    if (!entries.length) entries = await this.readNew(count);
    return entries;
  }

  /** Our own unacknowledged entries, each once (a cursor walks them). After a restart they
   *  count a delivery (XREADGROUP with an id does; the process may have died of them); after
   *  a failed call in this process they do not (XCLAIM ... RETRYCOUNT keeps the count). */
  async readOwnPending(count) {
    const { group, consumer } = this.opts;
    let entries;
    if (!this.rereadQuietly) {
      const reply = await this.r.xReadGroup(group, consumer, { key: this.source, id: this.ownCursor }, { COUNT: count });
      entries = await this.withDeliveries(this.entriesOf(reply));
    } else {
      const start = this.ownCursor === "0" ? "-" : "(" + this.ownCursor;
      const pending = await this.r.xPendingRange(this.source, group, start, "+", count, { consumer });
      entries = [];
      for (const p of pending) {
        const id = p.id.toString();
        const claimed = await this.r.xClaim(this.source, group, consumer, 0, [id], { RETRYCOUNT: p.deliveriesCounter });
        entries.push({ id, fields: claimed[0] ? claimed[0].message : null, deliveries: p.deliveriesCounter });
      }
    }
    if (entries.length) {
      this.ownCursor = entries[entries.length - 1].id;
    } else {
      this.ownDone = true;
      this.rereadQuietly = false;
    }
    return entries;
  }

  /** Entries idle for claimIdleMs on *another* consumer. XAUTOCLAIM would also hand us back
   *  entries we still hold ourselves (and count a delivery each time). */
  async claimStale(count) {
    const { group, consumer, claimIdleMs } = this.opts;
    const pending = await this.r.xPendingRange(this.source, group, "-", "+", count * 8, { IDLE: claimIdleMs });
    const ids = pending.filter((p) => p.consumer.toString() !== consumer).slice(0, count).map((p) => p.id.toString());
    if (!ids.length) return [];
    // The same min-idle-time again: if the owner touched an entry meanwhile, it stays its own.
    const claimed = await this.r.xClaim(this.source, group, consumer, claimIdleMs, ids);
    const present = claimed.filter((c) => c && c.message).map((c) => ({ id: c.id.toString(), fields: c.message, deliveries: 0 }));
    // Redis 6.2 returns an entry trimmed away while pending as nil and makes it ours: ack it.
    const gone = ids.filter((id) => !present.some((e) => e.id === id));
    if (gone.length) await this.r.xAck(this.source, group, gone);
    log("claimed", { from_dead_consumers: present.length, trimmed_away: gone.length });
    return this.withDeliveries(present);
  }

  async readNew(count) {
    const { group, consumer, blockMs } = this.opts;
    const reply = await this.r.xReadGroup(group, consumer, { key: this.source, id: ">" }, { COUNT: count, BLOCK: blockMs });
    return this.entriesOf(reply).map((e) => ({ ...e, deliveries: 1 }));
  }

  entriesOf(reply) {
    // node-redis v6's xReadGroup: null, or [{name, messages: [{id, message: {field: value}}]}]
    // (the raw RESP3 reply, through sendCommand, is a map keyed by stream name instead).
    const out = [];
    for (const stream of reply || []) {
      for (const m of stream.messages) out.push({ id: m.id.toString(), fields: m.message, deliveries: 1 });
    }
    return out;
  }

  /** Each entry's delivery count, from the pending entries list: XREADGROUP does not return it. */
  async withDeliveries(entries) {
    if (!entries.length) return entries;
    const { group, consumer } = this.opts;
    const pending = await this.r.xPendingRange(this.source, group, entries[0].id, entries[entries.length - 1].id, 4 * entries.length + 100, { consumer });
    const counts = new Map(pending.map((p) => [p.id.toString(), p.deliveriesCounter]));
    for (const e of entries) e.deliveries = counts.get(e.id) ?? 1;
    return entries;
  }

  // -- processing ---------------------------------------------------------------------

  async handle(entry) {
    const { maxDeliveries } = this.opts;
    if (!entry.fields) {
      await this.r.xAck(this.source, this.opts.group, [entry.id]); // trimmed away while pending: nothing to do
      return;
    }
    if (entry.deliveries > maxDeliveries) {
      await this.deadLetter(entry, `delivered ${entry.deliveries} times (max_deliveries=${maxDeliveries}) without being acknowledged: each consumer that took it stopped before committing it`);
      return;
    }
    let out;
    try {
      out = this.scoreEntry(entry.fields);
      // A task the trainer fed, or nothing: a grader that needs the answer or the tests reads
      // them from that PromptTask (answer, metadata_json), never from the group.
      const [task] = await this.r.hmGet(this.tasks, [out.taskId]);
      if (task === null) throw new BadEntry(`task ${JSON.stringify(out.taskId)} is not in ${this.tasks}: not a task the trainer fed`);
    } catch (e) {
      if (!(e instanceof BadEntry)) throw e;
      await this.deadLetter(entry, e.message);
      return;
    }
    const data = out.data;
    const done = await this.commit(this.output, entry.id, out.counter, "0", ["type", GROUP_TYPE, "schema", SCHEMA, "data", data]);
    if (!done) log("not_ours", { id: entry.id, note: "taken over or already committed: nothing written" });
  }

  /** The output for one entry: {data, counter}. Throws BadEntry with the dead-letter reason. */
  scoreEntry(fields) {
    const type = fields.type && fields.type.toString();
    if (type !== GROUP_TYPE) throw new BadEntry(`type is ${JSON.stringify(type)}, expected ${GROUP_TYPE}`);
    const schema = fields.schema && fields.schema.toString();
    if (schema !== SCHEMA) throw new BadEntry(`schema ${JSON.stringify(schema)} is not supported (this service reads ${SCHEMA})`);
    const data = fields.data || Buffer.alloc(0);
    let group;
    try {
      group = this.types.RolloutGroup.decode(data);
    } catch (e) {
      throw new BadEntry(`data does not parse as ${GROUP_TYPE}: ${e.message}`);
    }
    if (!group.groupId) throw new BadEntry("RolloutGroup has no group_id");
    const n = group.completions.length;
    if (!n) throw new BadEntry(`group ${group.groupId} has no completions`);
    if (group.groupSize && n !== group.groupSize) throw new BadEntry(`group ${group.groupId}: ${n} completions, the task asked for ${group.groupSize}`);
    if (group.scored) return { data, counter: "reward_passthrough", taskId: group.taskId }; // scored upstream: forwarded byte for byte
    const scores = group.completions.map((c, i) => {
      const s = score(c);
      const finite = Number.isFinite(s.reward) && Math.abs(s.reward) <= 1e4 && s.components.every((rc) => Number.isFinite(rc.value) && Number.isFinite(rc.weight));
      if (!finite) throw new BadEntry(`group ${group.groupId} completion ${i}: the grader gave reward ${s.reward}, not finite with |reward| <= 1e4`);
      return s;
    });
    return { data: spliceScores(data, scores, this.types.RewardComponent), counter: "scored", taskId: group.taskId };
  }

  async deadLetter(entry, reason) {
    const { group, consumer } = this.opts;
    const originalFields = {};
    for (const [k, v] of Object.entries(entry.fields || {})) originalFields[k] = v;
    const letter = this.types.DeadLetter.encode(this.types.DeadLetter.create({
      sourceStream: this.source, sourceId: entry.id, consumerGroup: group, consumer, reason,
      deliveries: entry.deliveries, originalFields, deadAt: Date.now() / 1000, // seconds since the epoch
    })).finish();
    const done = await this.commit(this.dead, entry.id, "dead_rollouts", DEAD_MAXLEN, ["type", DEAD_TYPE, "schema", SCHEMA, "data", Buffer.from(letter), "reason", reason]);
    if (done) log("dead_letter", { id: entry.id, reason });
  }

  async commit(output, id, counter, maxlen, fields) {
    const keys = [this.source, output, this.stats];
    const args = [this.opts.group, this.opts.consumer, id, counter, maxlen, ...fields];
    if (this.commitSha) {
      try {
        return (await this.r.evalSha(this.commitSha, { keys, arguments: args })) === 1;
      } catch (e) {
        if (!String(e.message).includes("NOSCRIPT")) throw e; // a restarted Redis forgot it
      }
    }
    this.commitSha = (await this.raw.scriptLoad(COMMIT)).toString();
    log("commit_script_loaded", { sha: this.commitSha });
    return (await this.r.evalSha(this.commitSha, { keys, arguments: args })) === 1;
  }

  // -- trimming (docs/custom-reward.md, "Trimming") -----------------------------------

  async trim() {
    let floor = null;
    for (const g of await this.r.xInfoGroups(this.source)) {
      let needed;
      if (g.pending > 0) {
        const summary = await this.r.xPending(this.source, g.name.toString());
        if (summary.firstId) needed = parseId(summary.firstId.toString());
      }
      if (!needed) {
        const [ms, seq] = parseId(g["last-delivered-id"].toString());
        needed = [ms, seq + 1n]; // the smallest id after last-delivered: everything up to it is acknowledged
      }
      if (floor === null || compareIds(needed, floor) < 0) floor = needed;
    }
    if (floor !== null) await this.r.xTrim(this.source, "MINID", `${floor[0]}-${floor[1]}`);
  }

  sleep(ms) {
    return new Promise((resolve) => {
      const t = setTimeout(resolve, ms);
      this.wake = () => {
        clearTimeout(t);
        resolve();
      };
    });
  }

  stop() {
    this.stopping = true;
    if (this.wake) this.wake();
    // Still waiting for Redis at start (node-redis retries the first connection forever): nothing is held, go.
    if (this.raw && !this.raw.isReady) this.raw.destroy();
  }

  async close() {
    try {
      await this.raw.close(); // waits for the command in flight
    } catch {
      this.raw.destroy();
    }
  }
}

// ---- settings -------------------------------------------------------------------------

function settings(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      "from-up": { type: "string" }, // WORKDIR/external-reward.json written by `rollstream up --external-reward`
      "redis-url": { type: "string" },
      "redis-username": { type: "string" },
      "redis-password-file": { type: "string" },
      run: { type: "string" },
      group: { type: "string" },
      consumer: { type: "string" },
      "output-stage": { type: "string" },
      "proto-dir": { type: "string" },
      count: { type: "string" },
      "block-ms": { type: "string" },
      "claim-idle-ms": { type: "string" },
      "max-deliveries": { type: "string" },
      "trim-every-ms": { type: "string" },
      "hold-ms": { type: "string" },
    },
  });
  const up = values["from-up"] ? JSON.parse(readFileSync(values["from-up"], "utf8")) : {};
  const env = process.env;
  const pick = (flag, envName, fromUp, fallback) => values[flag] ?? env[envName] ?? (fromUp !== undefined && fromUp !== "" ? fromUp : undefined) ?? fallback;
  const int = (name, text) => {
    const n = Number(text);
    if (!Number.isInteger(n) || n < 0) throw new Misconfigured(`--${name}: ${JSON.stringify(text)} is not a whole number`);
    return n;
  };
  const opts = {
    redisUrl: pick("redis-url", "REDIS_URL", up.redis_url, "redis://127.0.0.1:6379/0"),
    redisUsername: pick("redis-username", "REDIS_USERNAME", up.redis_username, ""),
    redisPasswordFile: pick("redis-password-file", "REDIS_PASSWORD_FILE", up.redis_password_file, ""),
    run: pick("run", "RUN", up.run, "demo"),
    group: pick("group", "GROUP", up.consumer_group, "reward"),
    consumer: pick("consumer", "CONSUMER", undefined, hostname()),
    outputStage: pick("output-stage", "OUTPUT_STAGE", up.output_stage, "scored"),
    protoDir: pick("proto-dir", "PROTO_DIR", undefined, path.resolve(HERE, "..", "..", "proto")),
    count: int("count", pick("count", "COUNT", undefined, "16")),
    blockMs: int("block-ms", pick("block-ms", "BLOCK_MS", undefined, "500")),
    claimIdleMs: int("claim-idle-ms", pick("claim-idle-ms", "CLAIM_IDLE_MS", up.claim_idle_ms, "30000")),
    maxDeliveries: int("max-deliveries", pick("max-deliveries", "MAX_DELIVERIES", up.max_deliveries, "5")),
    trimEveryMs: int("trim-every-ms", pick("trim-every-ms", "TRIM_EVERY_MS", undefined, "1000")),
    holdMs: int("hold-ms", pick("hold-ms", "HOLD_MS", undefined, "0")),
  };
  if (!["scored", "ready"].includes(opts.outputStage)) throw new Misconfigured(`--output-stage: ${JSON.stringify(opts.outputStage)} is not scored or ready`);
  if (!/^[A-Za-z0-9_.-]+$/.test(opts.run)) throw new Misconfigured(`--run: ${JSON.stringify(opts.run)} is not a run name`);
  // The password comes from a file (or REDIS_PASSWORD), never a flag: flags show in every process listing.
  opts.redisPassword = opts.redisPasswordFile ? readFileSync(opts.redisPasswordFile, "utf8").trim() : env.REDIS_PASSWORD || "";
  return opts;
}

async function loadTypes(protoDir) {
  const file = path.join(protoDir, "rollstream", "v1", "rollout.proto");
  if (!existsSync(file)) {
    // The default is the repository's proto/ folder, two levels up: a copy of this example
    // elsewhere must say where rollstream's proto/ is.
    throw new Misconfigured(`--proto-dir: no rollstream/v1/rollout.proto under ${protoDir} (give --proto-dir or PROTO_DIR: rollstream's proto/ folder)`);
  }
  const root = await protobuf.load(file);
  return {
    RolloutGroup: root.lookupType("rollstream.v1.RolloutGroup"),
    RewardComponent: root.lookupType("rollstream.v1.RewardComponent"),
    DeadLetter: root.lookupType("rollstream.v1.DeadLetter"),
  };
}

async function main() {
  let service;
  try {
    const opts = settings(process.argv.slice(2));
    service = new RewardService(opts, await loadTypes(opts.protoDir));
    process.on("SIGTERM", () => service.stop());
    process.on("SIGINT", () => service.stop());
    try {
      await service.connect();
    } catch (e) {
      if (!service.stopping) throw e;
    }
    if (!service.stopping) {
      await service.run();
      await service.close();
    }
    log("stopped");
    return 0;
  } catch (e) {
    if (e instanceof Misconfigured || AUTH_ERROR.test(String(e && e.message)) || e.code === "ENOENT" || String(e.code).startsWith("ERR_PARSE_ARGS")) {
      log("misconfigured", { error: String(e.message) });
      if (service) service.raw?.destroy();
      return 2;
    }
    throw e;
  }
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  process.exitCode = await main();
}
