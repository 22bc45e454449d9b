-- Argo CD health check for kvpool.dev/KVCachePool.
-- Install: argocd-cm `resource.customizations.health.kvpool.dev_KVCachePool` (see docs/helm.md).
-- kstatus rules: a status the operator wrote for an older generation says nothing about the
-- current spec, so it is Progressing until observedGeneration catches up; then Degraded wins
-- over Ready, and Ready=True is Healthy.
local hs = {}

local function conditions(status)
  local byType = {}
  if status.conditions ~= nil then
    for _, c in ipairs(status.conditions) do
      if c.type ~= nil then
        byType[c.type] = c
      end
    end
  end
  return byType
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  if c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvpool operator to report status"
  return hs
end

local status = obj.status
local generation = obj.metadata.generation
local observed = status.observedGeneration
if observed == nil or (generation ~= nil and observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvpool operator to observe generation " .. tostring(generation)
  return hs
end

local byType = conditions(status)
local ready = byType["Ready"]
local degraded = byType["Degraded"]
local configValid = byType["ConfigValid"]
local stalled = byType["Stalled"]

if configValid ~= nil and configValid.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(configValid, "Invalid configuration")
  return hs
end
if status.phase == "Invalid" then
  hs.status = "Degraded"
  hs.message = describe(configValid, "Invalid configuration")
  return hs
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "Degraded")
  return hs
end
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready, "Ready")
  return hs
end

hs.status = "Progressing"
hs.message = describe(byType["Progressing"], describe(ready, "Waiting for the pool to become ready"))
return hs
